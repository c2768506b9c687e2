"""The dense block-scaled FP8 GEMM in Triton: C [M, N] = (A [M, K] x B [N, K]^T) with A's 1x128 and B's 128x128
scales applied per K block in the fp32 accumulator.

BLOCK_K is 128, the scales' block, so each step of the K loop is one tensor-core dot of fp8 tiles [BM, 128] and
[128, BN] started from zero, then scaled by a_scale[rows, kb] x b_scale[cols // 128, kb] and added to the fp32
accumulator on the CUDA cores. The per-block add is also what keeps the accumulation in full fp32: Hopper's fp8 MMA
accumulates with fewer bits, so DeepSeek-V3 promotes partial sums every 128 K, as this loop does.

Rows, columns and the last K block are masked, so M, N and K need not be multiples of anything. Programs walk the
output in groups of GROUP_M row tiles, so neighbouring programs share B tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import BLOCK


@triton.jit
def fp8_block_dot(acc, a_ptrs, b_ptrs, a_scale_ptrs, b_scale_ptrs, row_ok, col_ok, K, s_ask, s_bsk, BLOCK_K: tl.constexpr):
    """acc + sum over K blocks kb of (A tile . B tile)(kb) * a_scale[:, kb] b_scale[:, kb]; the pointers address
    the first K block (A tile [BM, BK], B tile [BK, BN], the scale vectors [BM] and [BN])."""
    ks = tl.arange(0, BLOCK_K)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_s = tl.load(a_scale_ptrs + kb * s_ask, mask=row_ok, other=0.0)
        b_s = tl.load(b_scale_ptrs + kb * s_bsk, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K,
    s_am, s_ask, s_bn, s_bsn, s_bsk, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """A [M, K] fp8 (unit K stride), a_scale K-block-major (row stride 1, K-block stride s_ask), B [N, K] fp8 (unit
    K stride), b_scale [ceil(N / 128), ceil(K / 128)], C [M, N]."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + ks[None, :]
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * s_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = fp8_block_dot(acc, a_ptrs, b_ptrs, a_scale_ptr + rows, b_scale_ptr + (cols // BLOCK_K) * s_bsn, row_ok, col_ok, K, s_ask, s_bsk, BLOCK_K)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_config(M: int, N: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows and N columns. Few rows (decode) read the weight once
    and are bound by its bytes: narrow column tiles give more programs to stream it. Many rows are bound by the
    tensor cores: 128 x 128 tiles."""
    if M <= 64:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n = 64 if N >= 8192 else 32
        return block_m, block_n, 4, 5
    return 128, 128, 8, 4


def fp8_gemm_triton(
    x8: torch.Tensor, x_scale_t: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, M: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """The first M rows of x8 [M_pad, K] (scales x_scale_t [ceil(K / 128), M_pad], `quantize_rows_1x128_triton`)
    times w8 [N, K]^T (scales w_scale [ceil(N / 128), ceil(K / 128)]) -> [M, N] in out_dtype, fp32 accumulation.
    Both fp8 operands need a unit K stride."""
    K = x8.shape[1]
    N = w8.shape[0]
    out = torch.empty(M, N, device=x8.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    block_m, block_n, warps, stages = tile_config(M, N)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fp8_gemm_kernel[grid](
        x8, x_scale_t, w8, w_scale, out, M, N, K,
        x8.stride(0), x_scale_t.stride(0), w8.stride(0), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
