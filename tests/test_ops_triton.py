"""Triton kernels vs the naive fp32 references: sparse MLA forward / backward / split-K decode and indexer top-k.

Without CUDA these run on CPU through TRITON_INTERPRET=1 (set in conftest.py) at tiny shapes, in fp32 and fp16 (the
interpreter's bf16 dot is wrong in triton 3.9, so bf16 is covered by the GPU tests). `gpu`-marked tests run the same
checks at DeepSeek-V3.2 shapes in bf16 and check CUDA-graph capture. Outputs are NaN-poisoned before the kernel runs.
Every input comes from a seeded generator (make_mla's seed; the autouse fixture seeds torch's global generator for
the gradients drawn with randn_like), so a failure replays. Large query counts (past 65,535): tests/test_ops_large.py.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import sparse_mla_kernels

from dsaflow.ops.indexer_topk import indexer_scores_naive, indexer_topk
from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, indexer_topk_triton
from dsaflow.ops.sparse_mla import deterministic, function, sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla.dispatch import kernel_supports
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton
from dsaflow.ops.sparse_mla.triton_prefill import launch_sparse_mla_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
FP32_TOL = 2e-5  # sparse MLA: fp32 inputs use IEEE fp32 dots on the GPU too (measured ~1e-6)
INDEXER_FP32_TOL = 1e-4  # fp32 logits use IEEE dots on the GPU too


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)  # randn_like gradients below draw from the global generator


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten or invalid)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "-inf lse must mark exactly the queries with no key"
    fin = torch.isfinite(ref)
    assert ((lse[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item() < atol


def make_mla(B, T, H, d_qk, S, K, dtype, device=DEV, invalid=True, *, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d_qk, generator=g).to(device, dtype)
    kv = torch.randn(B, S, d_qk, generator=g).to(device, dtype)
    lo, hi = (-3, S + 3) if invalid else (0, S)
    idx = torch.randint(lo, hi, (B, T, K), generator=g, dtype=torch.int32).to(device)
    if invalid:
        idx[0, min(1, T - 1)] = -1  # one query with no valid key at all
    return q, kv, idx


def loss_of(out, lse, g_out, g_lse):
    return (out.float() * g_out).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * g_lse).sum()


def check_forward_backward(B, T, H, d_qk, d_v, S, K, dtype, tol, seed):
    q, kv, idx = make_mla(B, T, H, d_qk, S, K, dtype, seed=seed)
    scale = d_qk**-0.5
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = sparse_mla_kernels(q, kv, idx, scale, d_v)
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
    check_forward_backward(B=2, T=5, H=4, d_qk=40, d_v=32, S=23, K=16, dtype=dtype, tol=tol, seed=10)


def test_sparse_mla_no_tail_and_ragged_k():
    """d_qk == d_v (no rope tail), K not a multiple of the key block, H not a power of two."""
    check_forward_backward(B=1, T=3, H=3, d_qk=16, d_v=16, S=9, K=21, dtype=torch.float32, tol=FP32_TOL, seed=11)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_forward_folded_grid_writes_every_element(num_splits):
    """The 1-D grid folds (head block, query, split): 40 heads in 3 blocks of 16, 2 x 4 queries, 1 or 3 key splits
    (with splits, every partial is checked through the exact merge). Outputs start as NaN."""
    B, T, H, S, K = 2, 4, 40, 19, 40
    q, kv, idx = make_mla(B, T, H, 40, S, K, torch.float32, seed=12)
    over = dict(BLOCK_H=16, BLOCK_K=16)
    if num_splits == 1:
        out = torch.full((B, T, H, 32), float("nan"), device=DEV)
        lse = torch.full((B, T, H), float("nan"), device=DEV)
    else:
        out = torch.full((num_splits, B, T, H, 32), float("nan"), device=DEV)
        lse = torch.full((num_splits, B, T, H), float("nan"), device=DEV)
    launch_sparse_mla_fwd(q, kv, idx, 0.2, 32, out, lse, num_splits, over)
    if num_splits > 1:  # merge the partials in torch: every split program must have written its own slot
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        m = lse.amax(0).nan_to_num(neginf=0.0)
        w = torch.exp(lse - m)
        den = w.sum(0)
        out = (w.unsqueeze(-1) * out).sum(0) / den.clamp_min(1e-30).unsqueeze(-1)
        lse = torch.where(den == 0, float("-inf"), m + den.log())
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    assert rel_err(out, ref_out) < FP32_TOL
    check_lse(lse, ref_lse, FP32_TOL)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k_matches_naive(num_splits):
    q, kv, idx = make_mla(3, 2, 4, 40, 31, 40, torch.float32, seed=13)
    with torch.no_grad():
        out, lse = sparse_mla_decode_triton(q, kv, idx, 0.3, 32, num_splits=num_splits)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.3, 32)
    assert rel_err(out, ref_out) < FP32_TOL
    check_lse(lse, ref_lse, FP32_TOL)


def test_backward_dlse_only():
    """A gradient through lse alone (d_out = 0) must still reach q and kv."""
    q, kv, idx = make_mla(1, 3, 4, 40, 11, 16, torch.float32, seed=14)
    out, lse = sparse_mla_naive(q, kv, idx, 0.25, 32)
    g_lse = torch.randn_like(lse)
    dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out, lse, torch.zeros_like(out), g_lse, 0.25, 32)
    q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    _, ref_lse = sparse_mla_naive(q2, kv2, idx, 0.25, 32)
    ref_dq, ref_dkv = torch.autograd.grad((ref_lse.masked_fill(torch.isinf(ref_lse), 0) * g_lse).sum(), (q2, kv2))
    assert rel_err(dq, ref_dq) < 2 * FP32_TOL and rel_err(dkv, ref_dkv) < 2 * FP32_TOL


# Tiny blocks so that every 1-D grid folds several tiles: 40 heads = 3 head blocks of 16, d_v 32 = 2 column blocks,
# K 24 = 2 row blocks; G budgets of 4 (atomic) and 2 (deterministic) queries = 2 and 3 query chunks (last partial).
FOLD = dict(
    ds_BLOCK_H=16, dqg_BLOCK_H=16, gemm_BLOCK_K=16, gemm_BLOCK_N=16, gemm_BLOCK_J=16, red_BLOCK_E=2, red_BLOCK_D=16
)
BWD_VARIANTS = {
    "default": ({}, False),
    "folded_chunked": (dict(FOLD, g_max_bytes=4 * 2 * 40 * 24 * 4), False),
    "deterministic": ({}, True),
    "deterministic_folded_chunked": (dict(FOLD, det_max_bytes=2 * (2 * 40 * 24 * 4 + 24 * 40 * 4)), True),
}


@pytest.mark.parametrize("variant", list(BWD_VARIANTS))
def test_backward_variants_match_reference(variant):
    """Atomic and deterministic dkv, whole and in query chunks with folded grids; duplicate indices in a query
    (each slot contributes), invalid ones, a query without keys, and a dlse term."""
    over, det = BWD_VARIANTS[variant]
    q, kv, idx = make_mla(2, 3, 40, 40, 17, 24, torch.float32, seed=15)
    idx[1, 2, :5] = 7  # one row selected five times by one query
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out, g_lse, 0.2, 32, overrides=over, deterministic=det)
    q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(q2, kv2, idx, 0.2, 32)
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q2, kv2))
    assert rel_err(dkv, ref_dkv) < 2 * FP32_TOL
    assert rel_err(dq, ref_dq) < 2 * FP32_TOL
    if det:  # a second run is bit-identical
        dq2, dkv2 = sparse_mla_bwd_triton(
            q, kv, idx, out, lse, g_out, g_lse, 0.2, 32, overrides=over, deterministic=True
        )
        assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)


def test_deterministic_switch_reaches_backward(monkeypatch):
    """The process-wide switch (context manager here) is read when backward runs, and restored after the block."""
    seen = []
    real = function.sparse_mla_bwd_triton

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(function, "sparse_mla_bwd_triton", spy)
    q, kv, idx = make_mla(1, 2, 4, 40, 9, 16, torch.float32, seed=16)
    q.requires_grad_(True)
    for det in (False, True, False):
        out, lse = sparse_mla_kernels(q, kv, idx, 0.2, 32)
        with deterministic(det):
            out.sum().backward()
    assert seen == [False, True, False]


def test_unsupported_shapes_raise():
    """No silent fallback: shapes the kernels refuse raise with the shape and the reason; empty inputs launch
    nothing and equal the reference."""
    q, kv, idx = make_mla(1, 2, 2, 700, 8, 4, torch.float32, device="cpu", seed=17)
    assert "d_v=600" in kernel_supports(q, kv, idx, 600)
    with pytest.raises(ValueError, match=r"d_v=600.*kernels take 0 < d_v <= 512"):
        sparse_mla_kernels(q, kv, idx, 0.1, 600)
    q32, kv32, idx32 = make_mla(1, 2, 2, 576, 8, 4, torch.float32, device="cpu", seed=18)
    with pytest.raises(ValueError, match=r"\(1, 2, 2, 576\).*fp32 with d_qk=576"):
        sparse_mla_kernels(q32, kv32, idx32, 0.1, 512)
    with pytest.raises(ValueError, match="dtypes"):
        sparse_mla_kernels(q32.half()[..., :40], kv32[..., :40], idx32, 0.1, 32)
    assert kernel_supports(q32.half(), kv32.half(), idx32, 512) is None
    qe, kve, idxe = q32[:, :0, :, :40], kv32[..., :40], idx32[:, :0]
    out, lse = sparse_mla_kernels(qe, kve, idxe, 0.1, 32)
    assert out.shape == (1, 0, 2, 32) and lse.shape == (1, 0, 2)
    out, lse = sparse_mla_kernels(q32[..., :40], kv32[:, :0, :40], idx32, 0.1, 32)  # no kv row: no key anywhere
    assert (out == 0).all() and out.shape == (1, 2, 2, 32) and torch.isneginf(lse).all()


def make_indexer(B, T, H, D, S, dtype, device=DEV, *, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, S, D, generator=g).to(device, dtype)
    w = torch.randn(B, T, H, generator=g).to(device, dtype)
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
    q, k, w = make_indexer(B, T, H, D, S, dtype, seed=31)
    positions = torch.tensor([[-1, 0, 3, 10, 30, 36], [5, 6, 7, 20, 2, -5]], device=DEV)
    buf = torch.full((B, T, S), float("nan"), device=DEV)
    logits = indexer_logits_triton(q, k, w, positions, out=buf)
    ref = indexer_scores_naive(q, k, w, positions)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref))
    assert rel_err(logits.nan_to_num(0, 0, 0), ref.nan_to_num(0, 0, 0)) < INDEXER_FP32_TOL
    idx = indexer_topk_triton(q, k, w, positions, topk, chunk=4)
    assert idx.dtype == torch.int32 and idx.shape == (B, T, topk)
    check_topk(idx, q, k, w, positions, topk, atol=INDEXER_FP32_TOL * ref[torch.isfinite(ref)].abs().max().item())


def test_indexer_topk_exact_ties_break_to_lower_index():
    """Zero key rows score exactly 0 for every query: among them the naive order holds (lower index first, and the
    lowest-index zero keys are the ones kept), so prefill over a sequence and decode over a longer cache select the
    same keys. Nonzero scores are compared as sets (their order can flip under tf32 on the GPU)."""
    from dsaflow.ops.indexer_topk import indexer_topk_naive

    B, T, H, D, S, topk = 1, 4, 2, 16, 40, 12
    q, k, w = make_indexer(B, T, H, D, S, torch.float16, seed=32)
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
    q, k, w = make_indexer(1, 3, 2, 16, 5, torch.float32, seed=33)
    positions = torch.tensor([[0, 2, 4]], device=DEV)
    idx = indexer_topk_triton(q, k, w, positions, 8)
    check_topk(idx, q, k, w, positions, 8, atol=INDEXER_FP32_TOL * 10)


# ---------------------------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
def test_gpu_sparse_mla_deepseek_shapes():
    """h128, d_qk 576, d_v 512, topk 2048, bf16 through the public op (CUDA dispatch)."""
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
@pytest.mark.parametrize("det", [False, True])
def test_gpu_backward_deepseek_shapes(det):
    """Atomic and deterministic dkv at h128/576/512/topk 2048 in bf16, with a dlse term, in 3 query chunks; the
    deterministic backward run twice is bit-identical (dq and dkv)."""
    q, kv, idx = make_mla(1, 40, 128, 576, 4096, 2048, torch.bfloat16, device="cuda", seed=4)
    out, lse = sparse_mla_naive(q.float(), kv.float(), idx, 576**-0.5, 512)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    g_per_q = 2 * 128 * 2048 * 2
    over = dict(g_max_bytes=16 * g_per_q, det_max_bytes=16 * (g_per_q + 2048 * 576 * 4))
    args = (q, kv, idx, out.bfloat16(), lse, g_out.bfloat16(), g_lse, 576**-0.5, 512)
    dq, dkv = sparse_mla_bwd_triton(*args, overrides=over, deterministic=det)
    q2, kv2 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(q2, kv2, idx, 576**-0.5, 512)
    ref_dq, ref_dkv = torch.autograd.grad(loss_of(ref_out, ref_lse, g_out, g_lse), (q2, kv2))
    assert rel_err(dq, ref_dq) < 2e-2 and rel_err(dkv, ref_dkv) < 2e-2
    if det:
        for _ in range(2):
            dq2, dkv2 = sparse_mla_bwd_triton(*args, overrides=over, deterministic=True)
            assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)


@pytest.mark.gpu
def test_gpu_deterministic_public_op_repeated_rows():
    """Through the public op with the switch on: many queries selecting the same few rows (heavy dkv overlap, where
    atomics reorder most), bit-identical over three backward runs and close to the reference."""
    q, kv, idx = make_mla(2, 96, 16, 576, 256, 2048, torch.bfloat16, device="cuda", invalid=False, seed=5)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    g = torch.Generator(device="cuda").manual_seed(6)
    g_out = torch.randn(2, 96, 16, 512, device="cuda", generator=g)
    grads = []
    with deterministic():
        for _ in range(3):
            out, lse = sparse_mla(q, kv, idx, 576**-0.5, 512)
            grads.append(torch.autograd.grad((out.float() * g_out).sum(), (q, kv)))
    for dq, dkv in grads[1:]:
        assert torch.equal(dq, grads[0][0]) and torch.equal(dkv, grads[0][1])
    ref_out, _ = sparse_mla_naive(q.float(), kv.float(), idx, 576**-0.5, 512)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * g_out).sum(), (q, kv))
    assert rel_err(grads[0][0], ref_dq) < 2e-2 and rel_err(grads[0][1], ref_dkv) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiny_config(dtype):
    tol = 1e-2 if dtype == torch.bfloat16 else FP32_TOL  # fp32: IEEE dots, as on CPU
    check_forward_backward(B=2, T=7, H=4, d_qk=40, d_v=32, S=50, K=16, dtype=dtype, tol=tol, seed=7)


@pytest.mark.gpu
def test_gpu_fp32_is_ieee_at_small_config():
    """fp32 at the small model's attention shapes (8 heads, d_qk 160 = 128 + 32, topk 64): IEEE dots in every
    kernel, so fp32 lands within FP32_TOL of the fp32 reference (TF32 would be ~1e-3)."""
    check_forward_backward(B=2, T=64, H=8, d_qk=160, d_v=128, S=300, K=64, dtype=torch.float32, tol=FP32_TOL, seed=8)


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
    q, k, w = make_indexer(B, T, 64, 128, S, torch.bfloat16, device="cuda", seed=34)
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
