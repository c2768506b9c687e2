"""The grouped block-scaled FP8 GEMM in Triton: rows sorted by expert, each times its expert's fp8 weight, with the
dense kernel's per-K-block scaling (`triton_fp8_gemm.fp8_block_dot`).

Row tiles come from the MoE grouped GEMM's device-side tile table (`moe.triton_grouped.tile_table`: a static number
of slots, each mapped to (expert, first row, end row) on the device), so nothing syncs the host and CUDA graphs
capture the launch. The table is built over E + 1 groups, the last one being the rows past offsets[-1]: its tiles
write zeros (an early exit, so the K loop of the expert tiles runs unbranched and is software-pipelined), so every
output row is written whatever the routing. Rows and columns are clamped into the tile rather than masked, and K
is unmasked when K % 128 == 0, as in the dense kernel. Programs walk (slot, column tile) in groups of GROUP_M
slots (`swizzled_tile`), so the programs running together share activation rows and expert weights in L2. The launch is `tile_configs.grouped_config` (a table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe.triton_grouped import swizzled_tile, tile_table
from .naive import BLOCK
from .tile_configs import FP8TileConfig, grouped_config
from .triton_fp8_gemm import fp8_block_dot


@triton.jit
def _fp8_grouped_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, tile_expert_ptr, tile_row0_ptr, tile_rowend_ptr,
    N, K,
    s_am, s_ask, s_be, s_bn, s_bse, s_bsn, s_bsk, s_cm, s_cn,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    GROUP_M: tl.constexpr, PREFETCH_SCALES: tl.constexpr = False,
):
    """C[m] = A[m] . B[e(m)]^T for the rows of one tile of expert e; zeros for a tile of group E (rows past the
    last expert); nothing for a slot past the last tile (group E + 1)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile, pid_n = swizzled_tile(tl.program_id(0), tl.num_programs(0) // tiles_n, tiles_n, GROUP_M)
    e = tl.load(tile_expert_ptr + tile)
    if e > E:
        return
    row0 = tl.load(tile_row0_ptr + tile)
    row_end = tl.load(tile_rowend_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
    c_mask = (rows < row_end)[:, None] & (cols < N)[None, :]
    if e == E:  # the rows past offsets[-1]: zeros, and no K loop (so the loop below runs unbranched)
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    # clamped into the tile's rows and the expert's columns: no masks on the loads, the store drops the extras
    rows_in = tl.minimum(rows, row_end - 1)
    cols_in = cols % N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None].to(tl.int64) * s_am + ks[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * s_be + cols_in[None, :].to(tl.int64) * s_bn + ks[:, None]
    if BLOCK_K % BLOCK_N == 0:  # the tile lies in one weight-scale block
        b_scale_ptrs = b_scale_ptr + e.to(tl.int64) * s_bse + (pid_n * BLOCK_N // BLOCK_K) * s_bsn
    else:
        b_scale_ptrs = b_scale_ptr + e.to(tl.int64) * s_bse + (cols_in // BLOCK_K) * s_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = fp8_block_dot(acc, a_ptrs, b_ptrs, a_scale_ptr + rows_in, b_scale_ptrs, K, 0, tl.cdiv(K, BLOCK_K), s_ask, s_bsk, BLOCK_K, EVEN_K, BLOCK_K % BLOCK_N == 0, PREFETCH_SCALES)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def fp8_grouped_mm_triton(
    x8: torch.Tensor,
    x_scale_t: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    M: int,
    out_dtype: torch.dtype,
    config: FP8TileConfig | None = None,
) -> torch.Tensor:
    """The first M rows of x8 [M_pad, K] (sorted by expert; scales x_scale_t [ceil(K / 128), M_pad]) times their
    experts' w8 [E, N, K]^T (scales w_scale [E, ceil(N / 128), ceil(K / 128)]); offsets int32 [E] cumulative row
    ends -> [M, N] in out_dtype, rows past offsets[-1] zero. Both fp8 operands need a unit K stride. config: the
    launch (default `grouped_config(M, E, N)`; its block_m is also the tile table's row block)."""
    E, N, K = w8.shape
    out = torch.empty(M, N, device=x8.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:  # no K blocks: all zeros (and a K loop never starts empty)
        return out.zero_()
    config = config or grouped_config(M, E, N)
    block_m, block_n = config.block_m, config.block_n
    ends = torch.cat([offsets.to(torch.int32), offsets.new_full((1,), M, dtype=torch.int32)])
    expert, row0, row_end = tile_table(ends, M, block_m)
    grid = (expert.numel() * triton.cdiv(N, block_n),)
    _fp8_grouped_kernel[grid](
        x8, x_scale_t, w8, w_scale, out, expert, row0, row_end, N, K,
        x8.stride(0), x_scale_t.stride(0), w8.stride(0), w8.stride(1),
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0), out.stride(1),
        E=E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, EVEN_K=K % BLOCK == 0, GROUP_M=config.group_m,
        PREFETCH_SCALES=config.prefetch_scales, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
