"""Grouped GEMMs over rows sorted by expert, in Triton: the forward / input-gradient form and the weight-gradient
form. Groups are given by device-side offsets (`offsets[e]` = the end of expert e's rows), so nothing syncs the host
and the launch grid depends on shapes only: CUDA graphs capture both kernels.

Row tiles: expert e owns ceil(rows_e / BLOCK_M) tiles; `tile_table` maps a static number of tile slots
(ceil(M / BLOCK_M) + E, an upper bound of the sum) to (expert, first row, end row) on the device, and slots past
the last tile exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def swizzled_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in a 1-D grid of tiles_m x tiles_n output tiles, walked GROUP_M row
    tiles at a time across all column tiles, so programs that run together share row and column tiles in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row0_ptr, tile_rowend_ptr,
    N, K,
    s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[m, n] = sum_k A[m, k] * B[e(m), k, n] for the rows m of one tile of expert e."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile, pid_n = swizzled_tile(tl.program_id(0), tl.num_programs(0) // tiles_n, tiles_n, GROUP_M)
    e = tl.load(tile_expert_ptr + tile)
    if e >= E:
        return
    row0 = tl.load(tile_row0_ptr + tile)
    row_end = tl.load(tile_rowend_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * s_am + ks[None, :] * s_ak
    b_ptrs = b_ptr + e.to(tl.int64) * s_be + ks[:, None] * s_bk + cols[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, offsets_ptr,
    N, K,
    s_am, s_an, s_bm, s_bk, s_ce, s_cn, s_ck,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """C[e, n, k] = sum over expert e's rows m of A[m, n] * B[m, k] (zero for an expert without rows)."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    n_ok = ns < N
    k_ok = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        m = m0 + ms
        m_ok = m < end
        a = tl.load(a_ptr + m[:, None].to(tl.int64) * s_am + ns[None, :] * s_an, mask=m_ok[:, None] & n_ok[None, :])
        b = tl.load(b_ptr + m[:, None].to(tl.int64) * s_bm + ks[None, :] * s_bk, mask=m_ok[:, None] & k_ok[None, :])
        if IEEE:
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    c_ptrs = c_ptr + e.to(tl.int64) * s_ce + ns[:, None] * s_cn + ks[None, :] * s_ck
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def row_block(rows: int, experts: int) -> int:
    """BLOCK_M for `rows` rows over `experts` experts: tiles near the mean rows per expert waste less on the
    ragged last tile of each expert (at least 16, the tensor-core minimum; at most 128)."""
    mean = max(1, rows // max(1, experts))
    return 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 64 else 128


def tile_table(offsets: torch.Tensor, rows: int, block_m: int):
    """offsets int32 [E] (cumulative row ends) -> (tile_expert, tile_row0, tile_rowend), each int32 [ceil(rows /
    block_m) + E]; slots past the last tile have expert E. Device-side, static shapes."""
    E = offsets.numel()
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    slot = torch.arange(triton.cdiv(rows, block_m) + E, device=offsets.device)
    expert = torch.searchsorted(tile_end, slot, right=True)
    e = expert.clamp(max=E - 1)
    row0 = starts[e] + (slot - (tile_end[e] - tiles[e])) * block_m
    return expert.int(), row0.int(), ends[e].int()


def _ieee(*tensors) -> bool:
    return any(t.dtype == torch.float32 for t in tensors)


def grouped_mm_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [M, K] (rows sorted by expert), b [E, K, N] (any strides), offsets int32 [E] -> c [M, N] in a.dtype,
    c[m] = a[m] @ b[e(m)] with fp32 accumulation. fp32 inputs multiply in full fp32 (no TF32)."""
    M, K = a.shape
    E, _, N = b.shape
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if M == 0:
        return c
    block_m = row_block(M, E)
    block_n, block_k = (64, 32) if a.dtype == torch.float32 else (128, 64)
    expert, row0, rowend = tile_table(offsets, M, block_m)
    grid = (expert.numel() * triton.cdiv(N, block_n),)
    _grouped_rows_kernel[grid](
        a, b, c, expert, row0, rowend, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        E=E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=_ieee(a, b), GROUP_M=8,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3,
    )  # fmt: skip
    return c


def grouped_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [M, N], b [M, K] (rows sorted by expert), offsets int32 [E] -> c [E, N, K] in a.dtype,
    c[e] = a[rows_e]^T @ b[rows_e] with fp32 accumulation."""
    M, N = a.shape
    K = b.shape[1]
    E = offsets.numel()
    c = torch.empty(E, N, K, device=a.device, dtype=a.dtype)
    block_m, block_n, block_k = (32, 64, 64) if a.dtype == torch.float32 else (64, 128, 128)
    grid = (E, triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _grouped_weight_grad_kernel[grid](
        a, b, c, offsets, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=_ieee(a, b), num_warps=8, num_stages=3,
    )  # fmt: skip
    return c
