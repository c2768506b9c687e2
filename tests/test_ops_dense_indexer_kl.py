"""Dense indexer KL (V3.2 dense warm-up loss): Triton kernels and the chunked reference vs the naive fp32 reference.

Without CUDA the kernels run in the Triton interpreter at tiny shapes (fp32, fp16). The naive reference itself is
checked against a float64 textbook computation. `gpu` tests run V3.2 shapes in bf16 and check that a dense-mode
training step at 16K context never holds a [T, S] tensor (peak memory).
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import planned, tokens
from ops_helpers import FakeCuda
from torch.utils._python_dispatch import TorchDispatchMode

from dsaflow.ops.dense_indexer_kl import dense_indexer_kl, dense_indexer_kl_chunked, dense_indexer_kl_naive
from dsaflow.ops.dense_indexer_kl.function import dense_indexer_kl_triton
from dsaflow.ops.dense_indexer_kl.triton_launch import _config, attn_lse_triton, kl_backward_triton, kl_forward_triton
from dsaflow.pipeline.stages import build_stages

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(L, B, T, H, D, HI, DI, dtype=torch.float32, device=DEV, seed=0, pad=True, scale=1.0):
    """Seeded attention q/k [L, B, T, H, D], indexer q_i/k_i/w, positions with padding queries (< 0)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(L, B, T, H, D, generator=g) * scale).to(device, dtype)
    k = torch.randn(L, B, T, H, D, generator=g).to(device, dtype)
    q_i = (torch.randn(B, T, HI, DI, generator=g) * DI**-0.5).to(device, dtype).requires_grad_(True)
    k_i = torch.randn(B, T, DI, generator=g).to(device, dtype).requires_grad_(True)
    w = torch.randn(B, T, HI, generator=g).to(device, dtype).requires_grad_(True)
    pos = torch.arange(T).expand(B, T).clone()
    if pad:
        pos[0, 2] = -1  # a padding query inside the sequence
        pos[-1, -3:] = -1  # right padding
    return q, k, q_i, k_i, w, pos.to(device)


def rel_err(x, ref):
    assert torch.isfinite(x).all(), "non-finite value (unwritten or invalid)"
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def textbook_f64(q, k, sm_scale, q_i, k_i, w, pos):
    """Float64 loss by explicit loops over layers and heads (independent of the naive reference's einsums)."""
    L, B, T, H, _ = q.shape
    S = k.shape[2]
    vis = torch.arange(S).view(1, 1, S) <= pos.cpu().unsqueeze(-1)
    target = torch.zeros(B, T, S, dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            s = (q[l, :, :, h].double() @ k[l, :, :, h].double().transpose(1, 2)) * sm_scale
            target += s.masked_fill(~vis, float("-inf")).softmax(-1).nan_to_num(0.0) / (L * H)
    logits = torch.einsum("bthd,bsd->bths", q_i.double(), k_i.double()).clamp_min(0)
    scores = (logits * w.double().unsqueeze(-1)).sum(2).masked_fill(~vis, float("-inf"))
    valid = pos >= 0
    logq = torch.where(vis, scores.log_softmax(-1).nan_to_num(0.0), torch.zeros_like(scores))
    kl = torch.where(vis, torch.xlogy(target, target) - target * logq, torch.zeros_like(target)).sum(-1)
    return (kl * valid).sum() / valid.sum()


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


# ------------------------------------------------------------------------------------------------ references (CPU)
def test_naive_reference_equals_float64_textbook():
    q, k, q_i, k_i, w, pos = make_inputs(2, 2, 9, 3, 8, 2, 8, device="cpu", seed=1)
    got = dense_indexer_kl_naive(q, k, 0.4, q_i, k_i, w, pos)
    ref = textbook_f64(q, k, 0.4, q_i, k_i, w, pos)
    assert ref.item() > 1e-2  # far from a trivial zero
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)


def test_chunked_reference_equals_naive_and_bounds_its_tensors():
    L, B, T, H, D, HI, DI = 2, 2, 29, 3, 8, 2, 8
    q, k, q_i, k_i, w, pos = make_inputs(L, B, T, H, D, HI, DI, device="cpu", seed=2)
    ref = dense_indexer_kl_naive(q, k, 0.3, q_i, k_i, w, pos)
    ref_g = grads(ref, q_i, k_i, w)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    Largest.numel = max(Largest.numel, o.numel())
            return out

    chunk = 4
    with Largest():
        got = dense_indexer_kl_chunked(q, k, 0.3, q_i, k_i, w, pos, chunk=chunk)
        got_g = grads(got, q_i, k_i, w)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_g, ref_g):
        assert rel_err(a, b) < 1e-5
    # The inputs themselves, or one chunk's [L, B, H, chunk, S]; never [.., T, S].
    assert Largest.numel <= max(q.numel(), L * B * H * chunk * T) < L * B * H * T * T


# ---------------------------------------------------------------------------------------- Triton (interpreter/GPU)
@pytest.mark.parametrize(
    "L,B,T,H,D,HI,DI,seed",
    [
        (1, 1, 21, 2, 16, 2, 16, 3),  # one served layer (the F layer alone)
        (3, 2, 37, 3, 24, 4, 16, 4),  # three served layers; D = 24 takes a partial 16-wide chunk; padding queries
        (2, 1, 50, 2, 40, 3, 24, 5),  # several query and key blocks; DI padded to 32
    ],
)
def test_triton_loss_and_gradients_match_naive_fp32(L, B, T, H, D, HI, DI, seed):
    q, k, q_i, k_i, w, pos = make_inputs(L, B, T, H, D, HI, DI, seed=seed, scale=2.0)
    ref = dense_indexer_kl_naive(q, k, D**-0.5, q_i, k_i, w, pos)
    ref_g = grads(ref, q_i, k_i, w)
    got = dense_indexer_kl_triton(q, k, D**-0.5, q_i, k_i, w, pos)
    got_g = grads(got, q_i, k_i, w)
    assert ref.item() > 1e-2 and got.dtype == torch.float32
    tol = 1e-5 if DEV == "cpu" else 1e-4
    torch.testing.assert_close(got, ref, rtol=tol, atol=1e-6)
    for name, a, b in zip(("dq_i", "dk_i", "dw"), got_g, ref_g):
        assert b.abs().sum() > 0, name
        assert rel_err(a, b) < 10 * tol, name


@pytest.mark.parametrize("block_t,block_s", [(16, 32), (32, 16)])
def test_triton_non_square_tiles_match_naive(block_t, block_s):
    """The GPU default tile is 64 x 128 (queries x keys): key blocks that straddle several query blocks and the
    reverse must give the same loss and gradients."""
    q, k, q_i, k_i, w, pos = make_inputs(2, 2, 45, 2, 16, 3, 16, seed=11, scale=2.0)
    ref = dense_indexer_kl_naive(q, k, 0.25, q_i, k_i, w, pos)
    ref_g = grads(ref, q_i, k_i, w)
    got = dense_indexer_kl_triton(q, k, 0.25, q_i, k_i, w, pos, overrides=dict(BLOCK_T=block_t, BLOCK_S=block_s))
    got_g = grads(got, q_i, k_i, w)
    tol = 1e-5 if DEV == "cpu" else 1e-4
    torch.testing.assert_close(got, ref, rtol=tol, atol=1e-6)
    for name, a, b in zip(("dq_i", "dk_i", "dw"), got_g, ref_g):
        assert rel_err(a, b) < 10 * tol, name


def test_triton_fp16_inputs_match_naive():
    q, k, q_i, k_i, w, pos = make_inputs(2, 2, 26, 2, 32, 2, 16, dtype=torch.float16, seed=6)
    ref = dense_indexer_kl_naive(q, k, 32**-0.5, q_i, k_i, w, pos)
    ref_g = grads(ref, q_i, k_i, w)
    got = dense_indexer_kl_triton(q, k, 32**-0.5, q_i, k_i, w, pos)
    got_g = grads(got, q_i, k_i, w)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-5)
    for a, b in zip(got_g, ref_g):
        assert a.dtype == torch.float16 and rel_err(a, b) < 1e-2  # dI is rounded to fp16 before the dots


def test_triton_kernels_write_every_output_and_skip_padding():
    """Buffers are NaN-poisoned by the launchers: every lse, KL, LSE_I and dw entry must be written; padding queries
    contribute 0 to the loss and get exactly zero gradient."""
    L, B, T, H, D, HI, DI = 2, 2, 23, 2, 16, 2, 16
    q, k, q_i, k_i, w, pos = make_inputs(L, B, T, H, D, HI, DI, seed=7)
    cfg = _config(T, T, D, DI, None)
    lse = attn_lse_triton(q, k, pos, 0.25, cfg)
    kl, lse_i = kl_forward_triton(q, k, lse, q_i.detach(), k_i.detach(), w.detach(), pos, 0.25, cfg)
    assert torch.isfinite(lse).all() and torch.isfinite(kl).all() and torch.isfinite(lse_i).all()
    pad = pos < 0
    assert pad.any() and (kl[pad] == 0).all() and (kl[pos > 0] > 1e-6).all()  # position 0: one key, KL 0
    coef = torch.rand(B, T, generator=torch.Generator().manual_seed(8)).to(DEV) * (~pad)
    dq_i, dk_i, dw = kl_backward_triton(q, k, lse, q_i.detach(), k_i.detach(), w.detach(), pos, lse_i, coef, 0.25, cfg)
    assert torch.isfinite(dw).all() and (dq_i[pad] == 0).all() and (dw[pad] == 0).all()
    ref_lse = torch.logsumexp(
        (torch.einsum("lbthd,lbshd->lbhts", q.float(), k.float()) * 0.25).masked_fill(
            ~(torch.arange(T, device=DEV).view(1, 1, T) <= pos.unsqueeze(-1))[None, :, None], float("-inf")
        ),
        -1,
    )
    ok = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[ok], ref_lse[ok] * 1.4426950408889634, rtol=1e-5, atol=1e-5)


def test_public_entry_uses_the_chunked_reference_on_cpu():
    q, k, q_i, k_i, w, pos = make_inputs(1, 1, 12, 2, 8, 2, 8, device="cpu", seed=9)
    torch.testing.assert_close(
        dense_indexer_kl(q, k, 0.5, q_i, k_i, w, pos),
        dense_indexer_kl_naive(q, k, 0.5, q_i, k_i, w, pos),
        rtol=1e-6,
        atol=1e-7,
    )


def test_dispatch_table_names_its_choice_and_refusals():
    """CPU: the chunked reference. A CUDA call (faked by `is_cuda`) runs the kernels, and the chunked reference in
    deterministic mode; the kernel's own rule names what it refuses (a CUDA call it refuses raises with that reason;
    see the GPU test below)."""
    from dsaflow.ops.dense_indexer_kl.dispatch import explain_dense_indexer_kl
    from dsaflow.ops.kernel_table import Choice

    q, k, q_i, k_i, w, _ = make_inputs(1, 1, 12, 2, 8, 2, 8, device="cpu", seed=9)
    assert explain_dense_indexer_kl(q, k, q_i, k_i, w) == Choice("chunked", ())
    cuda = explain_dense_indexer_kl(q, k, FakeCuda(q_i), k_i, w)
    assert cuda.kernel == "triton" and [name for name, _ in cuda.refused] == ["chunked"]
    assert "device cuda runs the kernels" in cuda.reasons()
    refused = explain_dense_indexer_kl(q, k, FakeCuda(q_i), k_i[:, :5], w)
    assert refused.kernel is None and "mismatched key sets" in dict(refused.refused)["triton"]
    torch.use_deterministic_algorithms(True)
    try:
        assert explain_dense_indexer_kl(q, k, FakeCuda(q_i), k_i, w).kernel == "chunked"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
def test_cuda_shapes_the_kernels_refuse_raise():
    q, k, q_i, k_i, w, pos = make_inputs(1, 1, 12, 2, 8, 2, 8, device="cuda", seed=9)
    with pytest.raises(ValueError, match=r"dense_indexer_kl: no kernel takes .*index head dim 512 > 256"):
        dense_indexer_kl(q, k, 0.5, q_i.new_zeros(*q_i.shape[:-1], 512), k_i.new_zeros(*k_i.shape[:-1], 512), w, pos)


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("L,T", [(1, 1000), (2, 640)])
def test_triton_v32_shapes_bf16(L, T):
    """V3.2 attention (128 heads, q/k 192) and indexer (64 heads x 128) shapes, bf16, ragged T, padding."""
    q, k, q_i, k_i, w, pos = make_inputs(L, 1, T, 128, 192, 64, 128, dtype=torch.bfloat16, seed=10 + L)
    ref = dense_indexer_kl_naive(q, k, 192**-0.5, q_i, k_i, w, pos)
    ref_g = grads(ref, q_i, k_i, w)
    got = dense_indexer_kl(q, k, 192**-0.5, q_i, k_i, w, pos)
    got_g = grads(got, q_i, k_i, w)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-4)
    for name, a, b in zip(("dq_i", "dk_i", "dw"), got_g, ref_g):
        assert rel_err(a, b) < 2e-2, name  # dI is rounded to bf16 before the gradient dots


@pytest.mark.gpu
def test_dense_training_at_16k_never_holds_a_t_by_s_tensor():
    """Tiny model, one 16K sequence, dense attention + dense indexer loss, forward and backward in bf16: a single
    [T, S] fp32 tensor would be 1 GiB, int32 causal indices too; the whole step must stay far below that."""
    T = 16384
    model, plan = planned("FSFS", "model.num_layers=4", f"model.max_seq_len={T}")
    (stage,) = build_stages(model, plan)
    stage = stage.cuda().train()
    x = tokens(1, T).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = stage(x, attn="dense", compute_indexer_loss=True)
    stage.indexer_loss.backward()
    out.float().logsumexp(-1).mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(stage.indexer_loss) and stage.indexer_loss.item() > 0
    assert peak < 2**29, f"peak {peak / 2**20:.0f} MiB: something [T, S]-sized was allocated"
