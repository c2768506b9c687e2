"""Triton kernels vs the naive fp32 references: sparse MLA forward / backward / split-K decode and indexer top-k.

Without CUDA these run on CPU through TRITON_INTERPRET=1 (set in conftest.py) at tiny shapes, in fp32 and fp16 (the
interpreter's bf16 dot is wrong in triton 3.9, so bf16 is covered by the GPU tests). `gpu`-marked tests run the same
checks at DeepSeek-V3.2 shapes in bf16 and check CUDA-graph capture. Outputs are NaN-poisoned before the kernel runs.
"""
from __future__ import annotations

import pytest
import torch

from dsaflow.ops.indexer_topk import indexer_scores_naive, indexer_topk
from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, indexer_topk_triton
from dsaflow.ops.sparse_mla import sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton
from dsaflow.ops.sparse_mla.triton_dispatch import kernel_supports, sparse_mla_triton
from dsaflow.ops.sparse_mla.triton_prefill import launch_sparse_mla_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
FP32_TOL = 1e-4 if DEV == "cpu" else 3e-3  # on the GPU an fp32 tl.dot runs in tf32


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten or invalid)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "-inf lse must mark exactly the queries with no key"
    fin = torch.isfinite(ref)
    assert ((lse[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item() < atol


def make_mla(B, T, H, d_qk, S, K, dtype, device=DEV, invalid=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(B, T, H, d_qk, generator=g).to(device, dtype)
    kv = torch.randn(B, S, d_qk, generator=g).to(device, dtype)
    lo, hi = (-3, S + 3) if invalid else (0, S)
    idx = torch.randint(lo, hi, (B, T, K), generator=g, dtype=torch.int32).to(device)
    if invalid:
        idx[0, min(1, T - 1)] = -1  # one query with no valid key at all
    return q, kv, idx


def loss_of(out, lse, g_out, g_lse):
    return (out.float() * g_out).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * g_lse).sum()


def check_forward_backward(B, T, H, d_qk, d_v, S, K, dtype, tol):
    q, kv, idx = make_mla(B, T, H, d_qk, S, K, dtype)
    scale = d_qk**-0.5
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = sparse_mla_triton(q, kv, idx, scale, d_v)
    ref_out, ref_lse = sparse_mla_naive(q.float(), kv.float(), idx, scale, d_v)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < tol
    check_lse(lse, ref_lse, atol=tol)
    assert (out[0, min(1, T - 1)] == 0).all()
    g_out, g_lse = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    dq, dkv = torch.autograd.grad(loss_of(out, lse, g_out, g_lse), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q, kv))
    assert dq.dtype == dtype and dkv.dtype == dtype
    assert rel_err(dq, ref_dq) < 2 * tol
    assert rel_err(dkv, ref_dkv) < 2 * tol


# ---------------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_sparse_mla_forward_backward_tiny(dtype):
    """The model's tiny config (H=4, d_qk=40, d_v=32, K=16): padded head/dim blocks, invalid and empty rows."""
    tol = FP32_TOL if dtype == torch.float32 else 5e-3
    check_forward_backward(B=2, T=5, H=4, d_qk=40, d_v=32, S=23, K=16, dtype=dtype, tol=tol)


def test_sparse_mla_no_tail_and_ragged_k():
    """d_qk == d_v (no rope tail), K not a multiple of the key block, H not a power of two."""
    check_forward_backward(B=1, T=3, H=3, d_qk=16, d_v=16, S=9, K=21, dtype=torch.float32, tol=FP32_TOL)


def test_forward_writes_every_element():
    q, kv, idx = make_mla(2, 4, 4, 40, 19, 16, torch.float32)
    out = torch.full((2, 4, 4, 32), float("nan"), device=DEV)
    lse = torch.full((2, 4, 4), float("nan"), device=DEV)
    launch_sparse_mla_fwd(q, kv, idx, 0.2, 32, out, lse)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    assert rel_err(out, ref_out) < FP32_TOL
    check_lse(lse, ref_lse, FP32_TOL)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k_matches_naive(num_splits):
    q, kv, idx = make_mla(3, 2, 4, 40, 31, 40, torch.float32)
    with torch.no_grad():
        out, lse = sparse_mla_decode_triton(q, kv, idx, 0.3, 32, num_splits=num_splits)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.3, 32)
    assert rel_err(out, ref_out) < FP32_TOL
    check_lse(lse, ref_lse, FP32_TOL)


def test_backward_dlse_only_and_poisoned_buffers():
    """A gradient through lse alone (d_out = 0) must still reach q and kv."""
    q, kv, idx = make_mla(1, 3, 4, 40, 11, 16, torch.float32)
    out, lse = sparse_mla_naive(q, kv, idx, 0.25, 32)
    g_lse = torch.randn_like(lse)
    dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out, lse, torch.zeros_like(out), g_lse, 0.25, 32)
    q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    _, ref_lse = sparse_mla_naive(q2, kv2, idx, 0.25, 32)
    ref_dq, ref_dkv = torch.autograd.grad((ref_lse.masked_fill(torch.isinf(ref_lse), 0) * g_lse).sum(), (q2, kv2))
    assert rel_err(dq, ref_dq) < 2 * FP32_TOL and rel_err(dkv, ref_dkv) < 2 * FP32_TOL


DKV_VARIANTS = {
    "fused": dict(dkv_mode="fused", dkv_BLOCK_H=16, dkv_BLOCK_K=16),
    "fused_s_first": dict(dkv_mode="fused", dkv_S_FIRST=True, dkv_BLOCK_H=16, dkv_BLOCK_K=16),
    # two-pass in 2 query chunks of at most 4 queries (the last one partial), head and row blocks padded
    "gemm_chunked": dict(dkv_mode="gemm", g_max_bytes=4 * 2 * 5 * 24 * 4, gemm_BLOCK_K=16, gemm_BLOCK_N=16),
    "gemm_dq_fused": dict(dkv_mode="gemm", dq_mode="fused", g_max_bytes=4 * 2 * 5 * 24 * 4),
    "fused_dq_gemm": dict(dkv_mode="fused", dq_mode="gemm", g_max_bytes=4 * 2 * 5 * 24 * 4),
}


@pytest.mark.parametrize("variant", list(DKV_VARIANTS))
def test_backward_dkv_kernel_variants(variant):
    """Every formulation of dkv (one-pass S^T = K.Q^T or S = Q.K^T; two-pass dS/P buffer + GEMM in query chunks)
    matches the reference, and so does dq on the chunked path."""
    q, kv, idx = make_mla(2, 3, 5, 40, 17, 24, torch.float32)
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out, g_lse, 0.2, 32, overrides=DKV_VARIANTS[variant])
    q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(q2, kv2, idx, 0.2, 32)
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q2, kv2))
    assert rel_err(dkv, ref_dkv) < 2 * FP32_TOL
    assert rel_err(dq, ref_dq) < 2 * FP32_TOL


def test_unsupported_shapes_fall_back_to_naive():
    q, kv, idx = make_mla(1, 2, 2, 700, 8, 4, torch.float32, device="cpu")
    assert "d_v=600" in kernel_supports(q, kv, idx, 600)
    out, lse = sparse_mla_triton(q, kv, idx, 0.1, 600)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.1, 600)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    q32, kv32, idx32 = make_mla(1, 2, 2, 576, 8, 4, torch.float32, device="cpu")
    assert "fp32" in kernel_supports(q32, kv32, idx32, 512)
    assert kernel_supports(q32.half(), kv32.half(), idx32, 512) is None


def make_indexer(B, T, H, D, S, dtype, device=DEV):
    q = torch.randn(B, T, H, D).to(device, dtype)
    k = torch.randn(B, S, D).to(device, dtype)
    w = torch.randn(B, T, H).to(device, dtype)
    return q, k, w


def check_topk(idx, q, k, w, positions, topk, atol):
    """Tie-robust: the selected keys are visible and distinct, their exact scores match the best `topk` scores, and
    -1 sits exactly where fewer than topk keys are visible."""
    scores = indexer_scores_naive(q, k, w, positions)  # [B, T, S] fp32
    S = scores.shape[-1]
    n_visible = (positions.long() + 1).clamp(0, S)  # [B, T]
    n_sel = (idx >= 0).sum(-1)
    assert torch.equal(n_sel, n_visible.clamp(max=topk)), "-1 padding must match the number of visible keys"
    assert torch.equal(idx >= 0, torch.arange(topk, device=idx.device) < n_sel.unsqueeze(-1)), "-1 only at the end"
    ref_vals = scores.topk(min(topk, S), dim=-1).values
    got = torch.gather(scores, -1, idx.long().clamp(min=0))
    ok = idx >= 0
    assert torch.isfinite(got[ok]).all(), "selected an invisible key"
    sorted_idx = torch.where(ok, idx.long(), -1 - torch.arange(topk, device=idx.device)).sort(-1).values
    assert (sorted_idx[..., 1:] != sorted_idx[..., :-1]).all(), "duplicate key selected"
    got_sorted = got.masked_fill(~ok, float("-inf")).sort(-1, descending=True).values[..., : ref_vals.shape[-1]]
    fin = torch.isfinite(ref_vals)
    assert torch.equal(torch.isfinite(got_sorted), fin)
    assert (got_sorted[fin] - ref_vals[fin]).abs().max().item() < atol


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_indexer_logits_and_topk_tiny(dtype):
    B, T, H, D, S, topk = 2, 6, 4, 32, 37, 8
    q, k, w = make_indexer(B, T, H, D, S, dtype)
    positions = torch.tensor([[-1, 0, 3, 10, 30, 36], [5, 6, 7, 20, 2, -5]], device=DEV)
    buf = torch.full((B, T, S), float("nan"), device=DEV)
    logits = indexer_logits_triton(q, k, w, positions, out=buf)
    ref = indexer_scores_naive(q, k, w, positions)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref))
    assert rel_err(logits.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0)) < FP32_TOL
    idx = indexer_topk_triton(q, k, w, positions, topk, chunk=4)
    assert idx.dtype == torch.int32 and idx.shape == (B, T, topk)
    check_topk(idx, q, k, w, positions, topk, atol=FP32_TOL * ref[torch.isfinite(ref)].abs().max().item())


def test_indexer_topk_exact_ties_break_to_lower_index():
    """Zero key rows score exactly 0 for every query: among them the naive order holds (lower index first, and the
    lowest-index zero keys are the ones kept), so prefill over a sequence and decode over a longer cache select the
    same keys. Nonzero scores are compared as sets (their order can flip under tf32 on the GPU)."""
    from dsaflow.ops.indexer_topk import indexer_topk_naive

    B, T, H, D, S, topk = 1, 4, 2, 16, 40, 12
    q, k, w = make_indexer(B, T, H, D, S, torch.float16)
    k[:, torch.arange(S) % 5 != 0] = 0.0  # only every fifth key has a nonzero score
    positions = torch.tensor([[7, 20, 33, 39]], device=DEV)
    idx = indexer_topk_triton(q, k, w, positions, topk)
    ref = indexer_topk_naive(q, k, w, positions, topk)
    scores = indexer_scores_naive(q, k, w, positions)
    for t in range(T):
        got_t, ref_t, sc = idx[0, t], ref[0, t], scores[0, t]
        assert torch.equal(got_t < 0, ref_t < 0)
        got_zero = got_t[(got_t >= 0) & (sc[got_t.long().clamp(min=0)] == 0)]
        ref_zero = ref_t[(ref_t >= 0) & (sc[ref_t.long().clamp(min=0)] == 0)]
        assert torch.equal(got_zero, ref_zero), "zero-score ties must be kept in ascending key order"
        assert set(got_t.tolist()) == set(ref_t.tolist())


def test_indexer_topk_wider_than_context():
    """topk > S: every visible key is selected, the rest is -1."""
    q, k, w = make_indexer(1, 3, 2, 16, 5, torch.float32)
    positions = torch.tensor([[0, 2, 4]], device=DEV)
    idx = indexer_topk_triton(q, k, w, positions, 8)
    check_topk(idx, q, k, w, positions, 8, atol=FP32_TOL * 10)


# ---------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
def test_gpu_sparse_mla_deepseek_shapes():
    """h128, d_qk 576, d_v 512, topk 2048, bf16 through the public op (CUDA dispatch)."""
    torch.manual_seed(1)
    q, kv, idx = make_mla(1, 48, 128, 576, 4096, 2048, torch.bfloat16, device="cuda", seed=1)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = sparse_mla(q, kv, idx, 576**-0.5, 512)
    ref_out, ref_lse = sparse_mla_naive(q.float(), kv.float(), idx, 576**-0.5, 512)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse, atol=2e-2)
    g_out, g_lse = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    dq, dkv = torch.autograd.grad(loss_of(out, lse, g_out, g_lse), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q, kv))
    assert rel_err(dq, ref_dq) < 2e-2 and rel_err(dkv, ref_dkv) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode,dq_mode", [("fused", "fused"), ("gemm", "fused"), ("gemm", "gemm")])
def test_gpu_backward_modes_deepseek_shapes(mode, dq_mode):
    """dkv/dq modes at h128/576/512/topk 2048 in bf16, with a dlse term and the gemm paths in 3 query chunks."""
    q, kv, idx = make_mla(1, 40, 128, 576, 4096, 2048, torch.bfloat16, device="cuda", seed=4)
    out, lse = sparse_mla_naive(q.float(), kv.float(), idx, 576**-0.5, 512)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    over = dict(dkv_mode=mode, dq_mode=dq_mode, g_max_bytes=16 * 2 * 128 * 2048 * 2)
    dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out.bfloat16(), lse, g_out.bfloat16(), g_lse, 576**-0.5, 512,
                                    overrides=over)
    q2, kv2 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(q2, kv2, idx, 576**-0.5, 512)
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q2, kv2))
    assert rel_err(dq, ref_dq) < 2e-2 and rel_err(dkv, ref_dkv) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiny_config(dtype):
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # fp32 dots run as tf32 on the GPU
    check_forward_backward(B=2, T=7, H=4, d_qk=40, d_v=32, S=50, K=16, dtype=dtype, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H", [(4, 1, 128), (8, 2, 16)])
def test_gpu_decode_and_cuda_graph(B, T, H):
    q, kv, idx = make_mla(B, T, H, 576, 8192, 2048, torch.bfloat16, device="cuda", seed=2)
    with torch.no_grad():
        out, lse = sparse_mla(q, kv, idx, 0.04, 512)
        ref_out, ref_lse = sparse_mla_naive(q.float(), kv.float(), idx, 0.04, 512)
        assert rel_err(out, ref_out) < 1e-2
        check_lse(lse, ref_lse, atol=2e-2)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sparse_mla(q, kv, idx, 0.04, 512)  # warm-up compiles outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = sparse_mla(q, kv, idx, 0.04, 512)
        q2, _, idx2 = make_mla(B, T, H, 576, 8192, 2048, torch.bfloat16, device="cuda", seed=3)
        q.copy_(q2)
        idx.copy_(idx2)
        graph.replay()
        eager = sparse_mla(q, kv, idx, 0.04, 512)
        assert torch.equal(g_out, eager[0]) and torch.equal(g_lse, eager[1])


@pytest.mark.gpu
def test_gpu_indexer_deepseek_shapes_and_graph():
    """64 index heads x 128, 8K context, the last 256 queries, topk 2048, bf16; graph replay equals eager."""
    B, T, S, topk = 1, 256, 8192, 2048
    q, k, w = make_indexer(B, T, 64, 128, S, torch.bfloat16, device="cuda")
    positions = torch.arange(S - T, S, device="cuda").unsqueeze(0)
    positions[0, :3] = torch.tensor([-1, 5, 1000])  # a padding query and two short contexts
    idx = indexer_topk(q, k, w, positions, topk)
    scores = indexer_scores_naive(q, k, w, positions)
    check_topk(idx, q, k, w, positions, topk, atol=2e-3 * scores[torch.isfinite(scores)].abs().max().item())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_idx = indexer_topk_triton(q, k, w, positions, topk, chunk=128)
    graph.replay()
    assert torch.equal(g_idx, indexer_topk_triton(q, k, w, positions, topk, chunk=128))
