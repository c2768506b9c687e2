"""The Gluon grouped FP8 GEMM (`gluon_fp8_grouped.py`) on an sm_90 GPU: against the fp32 reference over ragged
expert groups (empty experts, row counts off multiples of 128, rows past offsets[-1] zero, outputs NaN-poisoned
first) at DeepSeek-V3.2's expert shapes, bit-equal to itself across ring depths, and a CUDA-graph replay equal to an
eager call with no host sync. Skipped off sm_90. Run on a GPU machine:

    .venv/bin/python -m pytest -q -m gpu tests/test_fp8_gluon_gpu.py

Tolerance: `test_fp8_gemm_gpu.assert_within_bound` (the same bound as the Triton kernel's).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_gemm_gpu import assert_within_bound, capture, gen, poison_free_memory, ragged_offsets, weight

from dsaflow.ops.fp8_gemm import dequantize_blocks_128, dequantize_rows_1x128, fp8_grouped_mm_naive
from dsaflow.ops.fp8_gemm import quantize_rows_1x128 as quantize_rows_reference
from dsaflow.ops.fp8_gemm.gluon_fp8_grouped import fp8_grouped_mm_gluon, gluon_support_reason
from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_and_ieee_fp32_reference():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon FP8 kernel runs on sm_90 only")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def run_gluon(a, w8, w_scale, offsets, config=None, pad_rows=1):
    x8, x_scale_t = quantize_rows_1x128_triton(a, False, pad_rows)
    reason = gluon_support_reason(x8, w8)
    assert reason is None, reason
    return fp8_grouped_mm_gluon(x8, x_scale_t, w8, w_scale, offsets, a.shape[0], a.dtype, config)


def check_against_reference(out, a, w8, w_scale, offsets, what):
    assert out.shape == (a.shape[0], w8.shape[1]) and out.dtype == a.dtype
    ref = fp8_grouped_mm_naive(a.float(), w8, w_scale, offsets)
    aq = dequantize_rows_1x128(*quantize_rows_reference(a)).abs()
    absprod = torch.zeros_like(ref)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            absprod[start:end] = aq[start:end] @ dequantize_blocks_128(w8[e], w_scale[e]).abs().t()
        start = end
    assert_within_bound(out, ref, absprod, what)
    assert (out[start:] == 0).all(), f"{what}: rows past offsets[-1] must be zero"


# (E, N, K): V3.2's experts (gate/up 2 x 2048 = 4096 wide over 7168, down 7168 wide over 2048) at a few expert
# counts, and widths off the 128 grid (partial N and K blocks: TMA zero-fills)
SHAPES = [(16, 4096, 7168), (64, 7168, 2048), (256, 4096, 7168), (32, 576, 208), (8, 200, 400)]


@pytest.mark.parametrize("E,N,K", SHAPES)
@pytest.mark.parametrize("M", [7, 301, 2000])
def test_matches_the_reference_over_ragged_experts(M, E, N, K):
    a = torch.randn(M, K, device="cuda", generator=gen(M + K)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=N + E)
    offsets = ragged_offsets(M, E, seed=M + E)  # experts 0, E // 2 and E - 1 empty; ~5 % of rows past the last
    poison_free_memory()
    out = run_gluon(a, w8, w_scale, offsets)
    check_against_reference(out, a, w8, w_scale, offsets, f"gluon M={M} E={E} N={N} K={K}")


def test_every_row_in_one_expert_and_all_rows_past_the_last():
    M, E, N, K = 1000, 16, 4096, 7168
    a = torch.randn(M, K, device="cuda", generator=gen(1)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=5)
    for offsets in ([0] * 7 + [M] * 9, [0] * E, [M - 1] * E):
        offsets = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        poison_free_memory()
        out = run_gluon(a, w8, w_scale, offsets)
        check_against_reference(out, a, w8, w_scale, offsets, f"offsets {offsets.tolist()[:3]}...")


@pytest.mark.parametrize("K", [512, 640])  # an even and an odd count of K blocks
def test_half_empty_tiles_and_several_tiles_per_program(K):
    """Experts whose last tile holds 1, 63 or 64 rows (the second warpgroup's half is empty: it issues no MMA and
    only frees the ring's slots) or 65, 127, 128 rows, and more tiles than SMs, so each persistent program runs
    several and its ring runs on from one tile into the next (with 5 % of rows past the last expert: zero tiles)."""
    counts = [1, 63, 64, 0, 65, 127, 128, 129, 191, 192, 193, 0, 255, 256, 257, 320]
    E, N = len(counts), 2048
    M = sum(counts) + 100
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = torch.randn(M, K, device="cuda", generator=gen(K + 7)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=K + 7)
    poison_free_memory()
    out = run_gluon(a, w8, w_scale, offsets)
    check_against_reference(out, a, w8, w_scale, offsets, f"half tiles K={K}")
    assert torch.equal(run_gluon(a, w8, w_scale, offsets, {"STAGES": 2}), out)


@pytest.mark.parametrize("K", [128, 256, 384, 640])  # 1, 2, 3, 5 K blocks: the loop's odd / even tails
def test_short_k_loops(K):
    M, E, N = 300, 4, 256
    a = torch.randn(M, K, device="cuda", generator=gen(K)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=K)
    offsets = ragged_offsets(M, E, seed=K)
    poison_free_memory()
    check_against_reference(run_gluon(a, w8, w_scale, offsets), a, w8, w_scale, offsets, f"K={K}")


def test_ring_depths_and_tile_order_are_bit_equal():
    """The accumulation order is fixed (ascending K blocks), so the knobs change nothing in the result."""
    M, E, N, K = 2000, 16, 4096, 7168
    a = torch.randn(M, K, device="cuda", generator=gen(3)).bfloat16()
    w8, w_scale = weight(E, N, K, seed=3)
    offsets = ragged_offsets(M, E, seed=3)
    base = run_gluon(a, w8, w_scale, offsets)
    for cfg in ({"STAGES": 2}, {"STAGES": 4, "GROUP_M": 1}, {"STAGES": 6, "GROUP_M": 16}):
        assert torch.equal(run_gluon(a, w8, w_scale, offsets, cfg), base), cfg


def test_replays_from_a_cuda_graph_bit_equal_with_no_host_sync():
    """The routing changes between replays: the offsets are read on the device, the grid is static."""
    E, M, N, K = 16, 512, 1024, 2048
    a = torch.randn(M, K, device="cuda").bfloat16()
    w8, w_scale = weight(E, N, K, seed=2)
    offsets = ragged_offsets(M, E, seed=0)
    x8, x_scale_t = quantize_rows_1x128_triton(a, False, 1)

    def fn():
        return fp8_grouped_mm_gluon(x8, x_scale_t, w8, w_scale, offsets, M, torch.bfloat16)

    graph, out = capture(fn)
    for seed in range(3):
        new8, new_scale = quantize_rows_1x128_triton(torch.randn(M, K, device="cuda", generator=gen(seed)).bfloat16(),
                                                     False, 1)  # fmt: skip
        x8.copy_(new8)
        x_scale_t.copy_(new_scale)
        offsets.copy_(ragged_offsets(M, E, seed=seed + 1))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, eager), seed
