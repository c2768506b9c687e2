"""Sparse MLA kernels stop each query's key loop at its key extent (1 + the last slot holding a valid index).

Index layouts that exercise the bound: the top-k layout (valid prefix, then -1), -1 and out-of-range indices
interleaved before the last valid slot, rows with no valid key (all -1, or all >= S), a single valid slot first or
last, K not a multiple of any key block. Forward, lse, dq and dkv are compared with the naive fp32 reference; every
buffer the op allocates with torch.empty / empty_like (outputs, lse, dq, the backward's G and C buffers, n_keys) is
poisoned (NaN, or a negative int) first, so a read of a slot no kernel wrote, or an unwritten output, fails.
CPU runs go through the Triton interpreter at tiny shapes in fp32 / fp16; `gpu` tests run DeepSeek-V3.2 shapes in bf16
with the causal top-k layout of a 4096-token sequence. Inputs come from seeded generators.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import sparse_mla_kernels

from dsaflow.ops.sparse_mla import deterministic, sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton
from dsaflow.ops.sparse_mla.triton_prefill import key_extent, launch_sparse_mla_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = 2e-5
LAYOUTS = ("topk", "interleaved", "edges")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(4321)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors and -12345-filled int tensors while active."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-12345)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


def layout_indices(layout: str, B: int, T: int, S: int, K: int, g: torch.Generator) -> torch.Tensor:
    """indices [B, T, K] int32 (CPU). topk: query (b, t) has a valid prefix of n(b, t) slots (0, K, and seeded
    counts in between), then -1. interleaved: the same prefix with ~30 % of it replaced by -1 or S + 2 (the last
    prefix slot valid in some rows, invalid in others). edges: rows with one valid slot (first or last), no valid
    slot (-1 everywhere, or >= S everywhere), and a full row."""
    idx = torch.randint(0, S, (B, T, K), generator=g, dtype=torch.int32)
    n = torch.randint(0, K + 1, (B, T), generator=g)
    n.view(-1)[0], n.view(-1)[-1] = 0, K
    slot = torch.arange(K)
    if layout in ("topk", "interleaved"):
        idx[slot.expand(B, T, K) >= n.unsqueeze(-1)] = -1
        if layout == "interleaved":
            hole = (torch.rand(B, T, K, generator=g) < 0.3) & (slot < n.unsqueeze(-1))
            idx[hole] = torch.where(torch.rand(B, T, K, generator=g) < 0.5, -1, S + 2).int()[hole]
        return idx
    rows = idx.view(B * T, K)
    kinds = torch.arange(B * T) % 5
    rows[kinds == 0, 1:] = -1  # only slot 0
    rows[kinds == 1, :-1] = -1  # only the last slot
    rows[kinds == 2] = -1  # no key
    rows[kinds == 3] = S + torch.arange(K, dtype=torch.int32)  # no key: every index out of range
    return idx  # kinds == 4: all K slots valid


def expected_extent(idx: torch.Tensor, S: int) -> torch.Tensor:
    valid = (idx >= 0) & (idx < S)
    pos = torch.arange(1, idx.shape[-1] + 1, device=idx.device)
    return torch.where(valid, pos, 0).amax(-1).int()


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in a kernel output: an unwritten element or a read of unwritten memory"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse, ref, atol):
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "-inf lse must mark exactly the queries with no key"
    fin = torch.isfinite(ref)
    assert ((lse[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item() < atol


def make(layout, B, T, H, d_qk, S, K, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d_qk, generator=g).to(device, dtype)
    kv = torch.randn(B, S, d_qk, generator=g).to(device, dtype)
    return q, kv, layout_indices(layout, B, T, S, K, g).to(device)


def loss_of(out, lse, g_out, g_lse):
    return (out.float() * g_out).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * g_lse).sum()


def reference(q, kv, idx, scale, d_v, g_out, g_lse):
    q2, kv2 = q.detach().float().requires_grad_(True), kv.detach().float().requires_grad_(True)
    out, lse = sparse_mla_naive(q2, kv2, idx, scale, d_v)
    dq, dkv = torch.autograd.grad(loss_of(out, lse, g_out, g_lse), (q2, kv2))
    return out.detach(), lse.detach(), dq, dkv


# ---------------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_extent_kernel(layout, poisoned):
    """n_keys equals 1 + the last valid slot for every row, with K above one kernel block (1024) and ragged."""
    g = torch.Generator().manual_seed(1)
    for K in (1, 21, 1100):
        idx = layout_indices(layout, 2, 5, 37, K, g).to(DEV)
        assert torch.equal(key_extent(idx, 37), expected_extent(idx, 37))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_splits,use_extent", [(1, True), (1, False), (3, False), (3, True)])
def test_forward_layouts(layout, num_splits, use_extent, poisoned):
    """The forward kernel (16-row key blocks, K = 40: a ragged last block) on each layout, bounded by the key extent
    or over every slot, and through the no-grad launcher (three key splits merged, bounded or not)."""
    B, T, H, S, K = 2, 5, 6, 29, 40
    q, kv, idx = make(layout, B, T, H, 40, S, K, torch.float32, seed=2)
    over = dict(BLOCK_H=16, BLOCK_K=16)
    ref_out, ref_lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    if num_splits == 1:
        out = torch.full((B, T, H, 32), float("nan"), device=DEV)
        lse = torch.full((B, T, H), float("nan"), device=DEV)
        launch_sparse_mla_fwd(q, kv, idx, 0.2, 32, out, lse, 1, over, use_extent=use_extent)
    else:
        with torch.no_grad():
            out, lse = sparse_mla_decode_triton(
                q, kv, idx, 0.2, 32, num_splits=num_splits, overrides=over, use_extent=use_extent
            )
    assert rel_err(out, ref_out) < FP32_TOL
    check_lse(lse, ref_lse, FP32_TOL)
    none = ~((idx >= 0) & (idx < S)).any(-1)
    assert none.any() and (out[none] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_public_op_layouts(layout, dtype, poisoned):
    """Through the autograd op (n_keys computed once, shared by forward and backward): out, lse, dq, dkv with a dlse
    term; K = 21 is not a multiple of any key block."""
    tol = FP32_TOL if dtype == torch.float32 else 5e-3
    q, kv, idx = make(layout, 2, 6, 4, 40, 23, 21, dtype, seed=3)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = sparse_mla_kernels(q, kv, idx, 0.15, 32)
    g_out, g_lse = torch.randn(out.shape, device=DEV), torch.randn(lse.shape, device=DEV)
    dq, dkv = torch.autograd.grad(loss_of(out, lse, g_out, g_lse), (q, kv))
    ref_out, ref_lse, ref_dq, ref_dkv = reference(q, kv, idx, 0.15, 32, g_out, g_lse)
    assert rel_err(out, ref_out) < tol
    check_lse(lse, ref_lse, tol)
    assert rel_err(dq, ref_dq) < 2 * tol and rel_err(dkv, ref_dkv) < 2 * tol


# Folded tiles (3 head blocks of 16, 2 column blocks, 16-row dkv blocks over K = 40: three row blocks, the last
# ragged) and 2-3 query chunks, atomic and deterministic.
FOLD = dict(
    ds_BLOCK_H=16,
    dqg_BLOCK_H=16,
    gemm_BLOCK_K=16,
    gemm_BLOCK_N=16,
    gemm_BLOCK_J=16,
    red_BLOCK_E=2,
    red_BLOCK_D=16,
    g_max_bytes=5 * 2 * 40 * 40 * 4,
    det_max_bytes=4 * (2 * 40 * 40 * 4 + 40 * 40 * 4),
)
# dq and dkv blocks wider than pass 1's: they must not read G past what pass 1 wrote (n_keys rounded up to 16)
WIDE = dict(FOLD, ds_BLOCK_K=16, dqg_BLOCK_K=64, gemm_BLOCK_K=32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("blocks", ["fold", "wide"])
def test_backward_layouts(layout, det, blocks, poisoned):
    """The backward alone (n_keys computed inside), with and without dlse; deterministic mode bit-identical. The
    deterministic runs take one dlse case per layout (its interpreted kernels are the suite's slowest): with dlse
    for topk and edges, without for interleaved."""
    over = FOLD if blocks == "fold" else WIDE
    q, kv, idx = make(layout, 2, 5, 40, 40, 31, 40, torch.float32, seed=4)
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    for d_lse in ((None,) if layout == "interleaved" else (g_lse,)) if det else (g_lse, None):
        dq, dkv = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out, d_lse, 0.2, 32, overrides=over, deterministic=det)
        _, _, ref_dq, ref_dkv = reference(q, kv, idx, 0.2, 32, g_out, g_lse if d_lse is not None else 0 * g_lse)
        assert rel_err(dq, ref_dq) < 2 * FP32_TOL and rel_err(dkv, ref_dkv) < 2 * FP32_TOL
        if det:
            dq2, dkv2 = sparse_mla_bwd_triton(
                q, kv, idx, out, lse, g_out, d_lse, 0.2, 32, overrides=over, deterministic=True
            )
            assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)


def test_backward_strided_gradients(poisoned):
    """d_out as a head-strided view (the layout training hands over) and a strided d_lse: the same gradients as
    contiguous ones."""
    q, kv, idx = make("topk", 1, 4, 4, 40, 19, 24, torch.float32, seed=5)
    out, lse = sparse_mla_naive(q, kv, idx, 0.2, 32)
    big = torch.randn(1, 4, 8, 32, device=DEV)
    g_out = big[:, :, ::2]  # head stride 64, unit last stride
    g_lse = torch.randn(1, 4, 4, 3, device=DEV)[..., 0]  # last stride 3
    a = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out, g_lse, 0.2, 32)
    b = sparse_mla_bwd_triton(q, kv, idx, out, lse, g_out.contiguous(), g_lse.contiguous(), 0.2, 32)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GPU, real shapes
def causal_topk_indices(positions: torch.Tensor, K: int, g: torch.Generator) -> torch.Tensor:
    """The layout the indexer gives a causal sequence: query at position p selects min(p + 1, K) distinct keys in
    [0, p] (here a seeded random choice, best-first order being irrelevant to the kernels), then -1."""
    rows = []
    for p in positions.tolist():
        sel = torch.randperm(p + 1, generator=g)[:K].int()
        rows.append(torch.cat([sel, torch.full((K - sel.numel(),), -1, dtype=torch.int32)]))
    return torch.stack(rows).unsqueeze(0)


@pytest.mark.gpu
@pytest.mark.parametrize("det", [False, True])
def test_gpu_causal_topk_layout_deepseek_shapes(det, poisoned):
    """h128, d_qk 576, d_v 512, topk 2048, bf16, queries spread over a 4096-token causal sequence (positions 0, 1,
    short, around 2047/2048, long; a quarter of them with -1 holes before their last key): the public op (Gluon
    forward on sm_90) and both backward modes against the fp32 reference; deterministic mode bit-identical."""
    g = torch.Generator().manual_seed(6)
    S, K, H = 4096, 2048, 128
    pos = torch.tensor(
        [0, 1, 5, 63, 64, 65, 700, 2046, 2047, 2048, 2049, 3000, 4095]
        + torch.randint(0, S, (19,), generator=g).tolist()
    )
    idx = causal_topk_indices(pos, K, g)
    holes = (torch.rand(idx.shape, generator=g) < 0.1) & (torch.arange(len(pos)) % 4 == 0).view(1, -1, 1)
    idx[holes] = -1
    T = len(pos)
    q = torch.randn(1, T, H, 576, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    kv = torch.randn(1, S, 576, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    idx = idx.cuda()
    assert torch.equal(key_extent(idx, S), expected_extent(idx, S))
    g_out = torch.randn(1, T, H, 512, generator=g).cuda()
    g_lse = torch.randn(1, T, H, generator=g).cuda()
    grads = []
    with deterministic(det):
        for _ in range(2 if det else 1):
            out, lse = sparse_mla_kernels(q, kv, idx, 576**-0.5, 512)
            grads.append(torch.autograd.grad(loss_of(out, lse, g_out, g_lse), (q, kv)))
    ref_out, ref_lse, ref_dq, ref_dkv = reference(q, kv, idx, 576**-0.5, 512, g_out, g_lse)
    assert rel_err(out, ref_out) < 1e-2
    check_lse(lse, ref_lse, 2e-2)
    assert rel_err(grads[0][0], ref_dq) < 2e-2 and rel_err(grads[0][1], ref_dkv) < 2e-2
    if det:
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
