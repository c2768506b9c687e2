"""Sparse MLA at large query counts and long contexts (GPU only).

CUDA caps grid axes 1 and 2 at 65,535 programs; the kernels use 1-D grids and int64 offsets so that one call takes
B*T up to 2^20 queries and more, with contexts up to 256K rows. Full-size naive references would not fit, so each
test compares a fixed sample of query rows (the first, the last, both sides of 65,535 / 65,536, and seeded random
ones) against the naive fp32 op run on those rows alone, checks that every output element was written (outputs
NaN-poisoned, or gradients exactly 0 where nothing flows), and, for dkv, sends gradient only through the sampled
rows so the whole dkv equals the reference over those rows. Inputs come from seeded CUDA generators.
"""

from __future__ import annotations

import pytest
import torch

from dsaflow.ops.sparse_mla import sparse_mla, sparse_mla_naive
from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton
from dsaflow.ops.sparse_mla.triton_prefill import launch_sparse_mla_fwd

pytestmark = pytest.mark.gpu
D_QK, D_V = 576, 512
SCALE = D_QK**-0.5


def need_gib(gib: float) -> None:
    torch.cuda.empty_cache()  # earlier tests' blocks held by the caching allocator count as used otherwise
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs ~{gib} GiB of free GPU memory, {free / 2**30:.0f} free")


def make_large(B, T, H, S, K, seed):
    """q [B, T, H, 576], kv [B, S, 576] bf16, indices [B, T, K] int32 with ~1 % invalid (-2, -1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, S, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    lo = -max(1, S // 100)
    idx = torch.randint(lo, S, (B, T, K), device="cuda", dtype=torch.int32, generator=g).clamp_(min=-1)
    return q, kv, idx


def sample_tokens(T: int, seed: int, n_random: int = 24) -> torch.Tensor:
    """Token positions (used in every sequence of the batch): edges, the 2^16 boundary, seeded random ones."""
    fixed = [t for t in (0, 1, 65534, 65535, 65536, 65537, T - 1) if t < T]
    rnd = torch.randint(0, T, (n_random,), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor(sorted(set(fixed + rnd)), device="cuda")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse, ref, atol):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert ((lse[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item() < atol


@pytest.mark.parametrize(
    "B,T,H,S,K,gib",
    [
        (1, 65536, 128, 32768, 2048, 22),  # exactly 2^16 queries, DeepSeek-V3.2 heads
        (2, 65536, 128, 262144, 2048, 42),  # 131,072 queries over two 256K contexts
        (1, 2**20, 16, 262144, 512, 42),  # 2^20 queries (one TP-8 head shard), 256K context
    ],
)
def test_forward_large(B, T, H, S, K, gib):
    need_gib(gib)
    q, kv, idx = make_large(B, T, H, S, K, seed=T + H)
    out = torch.full((B, T, H, D_V), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, T, H), float("nan"), device="cuda")
    launch_sparse_mla_fwd(q, kv, idx, SCALE, D_V, out, lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was never written"
    ts = sample_tokens(T, seed=1)
    ref_out, ref_lse = sparse_mla_naive(q[:, ts].float(), kv.float(), idx[:, ts], SCALE, D_V)
    assert rel_err(out[:, ts], ref_out) < 1e-2
    check_lse(lse[:, ts], ref_lse, atol=2e-2)
    with torch.no_grad():  # the public op without grad (decode launcher: 1 or 2 key splits by its rule) agrees
        out2, lse2 = sparse_mla(q[:, -4096:], kv, idx[:, -4096:], SCALE, D_V)
    assert rel_err(out2, out[:, -4096:]) < 1e-2
    check_lse(lse2, lse[:, -4096:], atol=1e-4)


def test_decode_combine_past_int32_offsets():
    """Split-K + combine with n_rows * d_v = 131072 x 40 heads x 512 > 2^31 elements (int64 offsets in the combine
    kernel and the split partials): equal to the one-split result (prefill kernel) everywhere."""
    need_gib(48)
    q, kv, idx = make_large(1, 131072, 40, 65536, 256, seed=3)
    with torch.no_grad():
        one, lse1 = sparse_mla_decode_triton(q, kv, idx, SCALE, D_V, num_splits=1)
        two, lse2 = sparse_mla_decode_triton(q, kv, idx, SCALE, D_V, num_splits=2)
    assert rel_err(two, one) < 1e-2  # bf16 outputs merged from fp32 partials vs one pass
    check_lse(lse2, lse1, atol=1e-4)
    ts = sample_tokens(131072, seed=4)
    ref_out, _ = sparse_mla_naive(q[:, ts].float(), kv.float(), idx[:, ts], SCALE, D_V)
    assert rel_err(two[:, ts], ref_out) < 1e-2


@pytest.mark.parametrize(
    "B,T,H,S,K,gib",
    [
        (1, 65536, 128, 32768, 2048, 50),  # 2^16 queries at DeepSeek-V3.2 heads: 64 query chunks of G
        (1, 131072, 16, 262144, 2048, 16),  # 131,072 queries, 16 heads, 256K context
    ],
)
def test_backward_large(B, T, H, S, K, gib):
    """dq on sampled rows, dq exactly 0 elsewhere (no gradient flows there: every program wrote its rows), and dkv
    of the whole context equal to the reference over the sampled rows (the only ones with a gradient)."""
    need_gib(gib)
    q, kv, idx = make_large(B, T, H, S, K, seed=T + H + 1)
    ts = sample_tokens(T, seed=2)
    g = torch.Generator(device="cuda").manual_seed(5)
    g_out_s = torch.randn(B, len(ts), H, D_V, device="cuda", generator=g)
    g_lse_s = torch.randn(B, len(ts), H, device="cuda", generator=g)
    g_out = torch.zeros(B, T, H, D_V, device="cuda", dtype=torch.bfloat16)
    g_lse = torch.zeros(B, T, H, device="cuda")
    g_out[:, ts] = g_out_s.bfloat16()
    g_lse[:, ts] = g_lse_s
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = sparse_mla(q, kv, idx, SCALE, D_V)
    dq, dkv = torch.autograd.grad((out, lse), (q, kv), (g_out, g_lse))
    del out, lse, g_out
    q_s = q.detach()[:, ts].float().requires_grad_(True)
    kv_f = kv.detach().float().requires_grad_(True)
    ref_out, ref_lse = sparse_mla_naive(q_s, kv_f, idx[:, ts], SCALE, D_V)
    loss = (ref_out * g_out_s.bfloat16().float()).sum()
    loss = loss + (ref_lse.masked_fill(torch.isinf(ref_lse), 0) * g_lse_s).sum()
    ref_dq, ref_dkv = torch.autograd.grad(loss, (q_s, kv_f))
    assert rel_err(dq[:, ts], ref_dq) < 2e-2
    assert rel_err(dkv, ref_dkv) < 2e-2
    dq[:, ts] = 0
    assert torch.count_nonzero(dq).item() == 0, "dq of a row without gradient must be exactly 0 (written, not left)"
