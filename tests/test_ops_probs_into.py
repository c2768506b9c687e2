"""`sparse_mla(..., probs_into=)`: the indexer-loss target (head-summed, L1-normalised attention probabilities over
each query's slots) added by the attention's backward, against the fp32 reference `attention_target_naive`.

CPU runs the backward kernels through the Triton interpreter at tiny shapes (fp32); `gpu` tests run V3.2 shapes in
bf16 through the public op, in query chunks, and check that the result is bit-identical across runs."""

import pytest
import torch
from test_ops_triton import FOLD, make_mla, rel_err

from dsaflow.ops.indexer_loss import attention_target_naive
from dsaflow.ops.sparse_mla import sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton


def _prefilled(B, T, K, seed, device="cpu"):
    """A target buffer that already holds another layer's share (the kernel must add, not overwrite)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, K, generator=g).to(device)


@pytest.mark.parametrize("over", [{}, dict(FOLD, g_max_bytes=4 * 2 * 40 * 24 * 4)], ids=["whole", "folded_chunked"])
@pytest.mark.parametrize("det", [False, True])
def test_backward_adds_the_attention_target(over, det):
    """40 heads (3 head blocks of 16 when folded), duplicate and invalid slots, a query without keys, rows whose
    valid slots end early (their key extent), a target that is a strided slice of a larger buffer."""
    q, kv, idx = make_mla(2, 5, 40, 40, 17, 24, torch.float32, seed=21)
    idx[1, 2, :5] = 7
    idx[0, 3, 9:] = -1  # valid slots end at 9
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    base = _prefilled(2, 9, 24, seed=3)
    target = base[:, 2:7]  # rows 2..6 of a 9-row buffer
    before = target.clone()
    dq, dkv = sparse_mla_bwd_triton(
        q, kv, idx, out, lse, g_out, g_lse, 0.2, 32, overrides=over, deterministic=det, probs_into=(target, 0.25)
    )
    ref = attention_target_naive(q, kv, idx, lse, 0.2, before.clone(), 0.25)
    assert rel_err(target, ref) < 1e-5
    torch.testing.assert_close(target[0, 1], before[0, 1])  # no key: nothing added
    assert torch.equal(base[:, :2], _prefilled(2, 9, 24, seed=3)[:, :2])  # rows outside the slice untouched
    dq0, dkv0 = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out, g_lse, 0.2, 32, overrides=over, deterministic=det)
    assert torch.equal(dq, dq0) and (not det or torch.equal(dkv, dkv0))  # the gradients do not change


def test_backward_refuses_a_bad_target():
    q, kv, idx = make_mla(1, 3, 4, 40, 9, 8, torch.float32, seed=2)
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    for bad in (torch.zeros(1, 3, 8, dtype=torch.float64), torch.zeros(1, 3, 7), torch.zeros(1, 3, 16)[..., ::2]):
        with pytest.raises(ValueError, match="probs_into"):
            sparse_mla_bwd_triton(q, kv, idx, out, lse, torch.ones_like(out), None, 0.2, 32, probs_into=(bad, 1.0))


def test_public_op_on_cpu_adds_at_once():
    q, kv, idx = make_mla(2, 4, 3, 24, 11, 6, torch.float32, device="cpu", seed=5)
    target = torch.zeros(2, 4, 6)
    out, lse = sparse_mla(q, kv, idx, 0.3, 16, probs_into=(target, 0.5))
    torch.testing.assert_close(target, attention_target_naive(q, kv, idx, lse, 0.3, None, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("with_grad", [True, False])
def test_gpu_public_op_v32_shapes(with_grad, monkeypatch):
    """bf16, h128, 576/512, topk 2048, 3 query chunks of the backward: the target after backward (with grad) or at
    once (no grad) matches the fp32 reference on the op's own lse; two runs with grad are bit-identical."""
    from dsaflow.ops.sparse_mla import triton_backward

    q, kv, idx = make_mla(1, 40, 128, 576, 4096, 2048, torch.bfloat16, device="cuda", seed=8)
    real = triton_backward.bwd_config
    monkeypatch.setattr(
        triton_backward, "bwd_config", lambda *a, **k: dict(real(*a, **k), g_max_bytes=16 * 2 * 128 * 2048 * 2)
    )  # 3 chunks
    results = []
    for _ in range(2 if with_grad else 1):
        target = _prefilled(1, 40, 2048, seed=1, device="cuda")
        before = target.clone()
        qq, kk = q.clone().requires_grad_(with_grad), kv.clone().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            out, lse = sparse_mla(qq, kk, idx, 576**-0.5, 512, probs_into=(target, 0.5))
            if with_grad:
                assert torch.equal(target, before)  # filled by the backward, not the forward
                out.float().pow(2).sum().backward()
        ref = attention_target_naive(q.float(), kv.float(), idx, lse, 576**-0.5, before, 0.5)
        assert rel_err(target, ref) < 1e-3
        results.append(target)
    if with_grad:
        assert torch.equal(results[0], results[1])
