"""The indexer-loss target from its own Q.K^T pass (`triton_probs.sparse_mla_probs_triton`, what runs after
cuDNN-Frontend's backward) against the fp32 reference `attention_target_naive` and against the target dsaflow's
backward adds from its pass 1 (`sparse_mla_bwd_triton(..., probs_into=)`).

CPU: the Triton interpreter at tiny shapes (fp32, one fp16 case), the partial sums NaN-poisoned, the target a
prefilled strided slice of a larger buffer. `gpu`: DeepSeek-V3.2 shapes in bf16 and an odd small shape, bit-identical
across runs and in CUDA-graph replay (needs no cuDNN-Frontend; its path is tested in test_ops_cudnn_peer.py).
"""

from __future__ import annotations

import pytest
import torch
from test_ops_triton import make_mla, rel_err

from dsaflow.ops.indexer_loss import attention_target_naive
from dsaflow.ops.sparse_mla import sparse_mla_naive
from dsaflow.ops.sparse_mla import triton_probs as tp
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton


@pytest.fixture
def poisoned(monkeypatch):
    """The partial sums start as NaN: a read of an entry the probs kernel did not write shows in the target."""
    monkeypatch.setattr(tp, "_empty", lambda *a, **k: torch.empty(*a, **k).fill_(float("nan")))


def _inputs(B, T, H, d_qk, S, K, dtype, seed, device="cpu"):
    """make_mla's indices (-3 .. S+2: -1-like and >= S entries, query (0, 1) with no valid key) plus a repeated
    row and a query whose valid slots end at slot 9 (its key extent)."""
    q, kv, idx = make_mla(B, T, H, d_qk, S, K, dtype, device=device, seed=seed)
    idx[-1, -1, :5] = 7
    idx[0, min(3, T - 1), 9:] = -1
    return q, kv, idx


# (H, d_qk, d_v, K, dtype, probs overrides, matching backward overrides): H 2-3 and 40 (three 16-head blocks, the
# last partial), a rope tail or none, K 17 / 24 / 40 (no multiple of the key block: 16 in fp32, 32 in fp16), chunks
# of 2 queries
FOLD = dict(BLOCK_H=16, max_bytes=2 * 3 * 41 * 4)  # three 16-head blocks, ps for 2 queries of K = 40 per chunk
CASES = {
    "h3_tail_k17": (3, 40, 32, 17, torch.float32, {}, {}),
    "h2_no_tail_k24": (2, 32, 32, 24, torch.float32, {}, {}),
    "h40_folded_chunked": (40, 40, 32, 40, torch.float32, FOLD, {"ds_BLOCK_H": 16}),
    "h3_fp16": (3, 40, 32, 24, torch.float16, {}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_probs_pass_adds_the_attention_target(case, poisoned):
    H, d_qk, d_v, K, dtype, over, bwd_over = CASES[case]
    B, T, T_buf = 2, 5, 9
    q, kv, idx = _inputs(B, T, H, d_qk, 13, K, dtype, seed=len(case))
    out, lse = sparse_mla_naive(q.float(), kv.float(), idx, 0.2, d_v)
    g = torch.Generator().manual_seed(3)
    base = torch.rand(B, T_buf, K, generator=g)
    target = base[:, 2 : 2 + T]  # a strided slice that already holds other layers' shares
    before = target.clone()
    tp.sparse_mla_probs_triton(q, kv, idx, lse, 0.2, d_v, (target, 0.25), overrides=over)
    ref = attention_target_naive(q.float(), kv.float(), idx, lse, 0.2, before.clone(), 0.25)
    assert rel_err(target, ref) < (1e-3 if dtype == torch.float16 else 1e-5)
    assert torch.equal(target[0, 1], before[0, 1])  # a query with no valid key adds nothing
    assert not torch.equal(target[0, 3], before[0, 3])
    torch.testing.assert_close((target - before)[0, 3, 9:], torch.zeros(K - 9))  # past its key extent: nothing
    torch.testing.assert_close((target - before).sum(-1)[0, 2], torch.tensor(0.25))  # normalised, times weight
    assert torch.equal(base[:, :2], torch.rand(B, T_buf, K, generator=torch.Generator().manual_seed(3))[:, :2])
    # dsaflow's backward adds the same target to rounding (the pass sums each slot's heads in another order)
    by_backward = before.clone()
    d_out = torch.randn(out.shape, generator=g).to(dtype)
    args = q, kv, idx, out.to(dtype), lse, d_out, None, 0.2, d_v
    sparse_mla_bwd_triton(*args, overrides=bwd_over, probs_into=(by_backward, 0.25))
    torch.testing.assert_close(target, by_backward, rtol=1e-5, atol=1e-6)


def test_probs_pass_with_given_key_extent_and_no_work(poisoned):
    """n_keys passed in (as the autograd Function does) gives the same target; no query or no slot adds nothing."""
    from dsaflow.ops.sparse_mla.triton_prefill import key_extent

    q, kv, idx = _inputs(1, 4, 3, 40, 11, 20, torch.float32, seed=4)
    _, lse = sparse_mla_naive(q, kv, idx, 0.3, 32)
    a, b = torch.zeros(1, 4, 20), torch.zeros(1, 4, 20)
    tp.sparse_mla_probs_triton(q, kv, idx, lse, 0.3, 32, (a, 1.0))
    tp.sparse_mla_probs_triton(q, kv, idx, lse, 0.3, 32, (b, 1.0), n_keys=key_extent(idx, 11))
    assert torch.equal(a, b) and rel_err(a, attention_target_naive(q, kv, idx, lse, 0.3)) < 1e-5
    empty = torch.zeros(1, 4, 0)
    tp.sparse_mla_probs_triton(q, kv, idx[..., :0], lse, 0.3, 32, (empty, 1.0))
    tp.sparse_mla_probs_triton(q[:, :0], kv, idx[:, :0], lse[:, :0], 0.3, 32, (torch.zeros(1, 0, 20), 1.0))


def test_probs_pass_refuses_a_bad_target():
    q, kv, idx = make_mla(1, 3, 4, 40, 9, 8, torch.float32, seed=2)
    _, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    for bad in (torch.zeros(1, 3, 8, dtype=torch.float64), torch.zeros(1, 3, 7), torch.zeros(1, 3, 16)[..., ::2]):
        with pytest.raises(ValueError, match="probs_into"):
            tp.sparse_mla_probs_triton(q, kv, idx, lse, 0.2, 32, (bad, 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,T,H,S,K,over",
    [
        (1, 40, 128, 4096, 2048, {}),
        (1, 40, 128, 4096, 2048, dict(max_bytes=16 * 2 * 2049 * 4)),
        (2, 33, 20, 300, 100, {}),
    ],
    ids=["v32", "v32_chunked", "h20_k100"],
)
def test_gpu_probs_pass(B, T, H, S, K, over, poisoned):
    """bf16, d_qk 576 / d_v 512: against the fp32 reference on the forward's own lse and against dsaflow's backward's
    target; two runs and a CUDA-graph replay add bit-identical amounts."""
    from dsaflow.ops.sparse_mla.triton_prefill import key_extent, sparse_mla_fwd_triton

    q, kv, idx = _inputs(B, T, H, 576, S, K, torch.bfloat16, seed=H, device="cuda")
    scale = 576**-0.5
    n_keys = key_extent(idx, S)
    out, lse = sparse_mla_fwd_triton(q, kv, idx, scale, 512, n_keys=n_keys)
    before = torch.rand(B, T, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    runs = []
    for _ in range(2):
        target = before.clone()
        tp.sparse_mla_probs_triton(q, kv, idx, lse, scale, 512, (target, 0.5), n_keys=n_keys, overrides=over)
        runs.append(target)
    assert torch.equal(runs[0], runs[1])
    ref = attention_target_naive(q.float(), kv.float(), idx, lse, scale, before.clone(), 0.5)
    assert rel_err(runs[0] - before, ref - before) < 1e-3
    assert torch.equal(runs[0][0, 1], before[0, 1])
    by_backward = before.clone()
    args = q, kv, idx, out, lse, torch.randn_like(out), None, scale, 512
    sparse_mla_bwd_triton(*args, n_keys=n_keys, probs_into=(by_backward, 0.5))
    assert rel_err(runs[0] - before, by_backward - before) < 1e-5
    captured = before.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, allocates)
        tp.sparse_mla_probs_triton(q, kv, idx, lse, scale, 512, (before.clone(), 0.5), n_keys=n_keys, overrides=over)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp.sparse_mla_probs_triton(q, kv, idx, lse, scale, 512, (captured, 0.5), n_keys=n_keys, overrides=over)
    captured.copy_(before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, runs[0])
