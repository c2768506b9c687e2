"""The dense block-scaled FP8 GEMM in Triton: C [M, N] = (A [M, K] x B [N, K]^T) with A's 1x128 and B's 128x128
scales applied per K block in the fp32 accumulator.

BLOCK_K is 128, the scales' block, so each step of the K loop is one tensor-core dot of fp8 tiles [BM, 128] and
[128, BN] started from zero, then scaled by a_scale[rows, kb] x b_scale[cols // 128, kb] and added to the fp32
accumulator on the CUDA cores. The per-block add is also what keeps the accumulation in full fp32: Hopper's fp8 MMA
accumulates with fewer bits, so DeepSeek-V3 promotes partial sums every 128 K, as this loop does.

The K loop is kept in the form Triton's software pipeliner multi-buffers (cp.async into a num_stages-deep
shared-memory ring): no branch around it, rows and columns clamped into range instead of masked (a clamped row or
column only feeds output elements the store masks off), and no K mask when K % 128 == 0 (EVEN_K). A tile no wider
than 128 columns lies in one weight-scale block, so its weight scale is one scalar load per K block.

Launch: `tile_configs.dense_config(M, N)` (a table, no autotuning). For few rows the table may split K over several
programs (fp32 partials [SPLIT, M, N], summed by `_sum_partials_kernel`) and may fuse the activations'
quantization into the A load (bit-equal to `triton_act_quant`). Programs walk the output in groups of GROUP_M row
tiles, so neighbouring programs share B tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe.triton_grouped import swizzled_tile
from .naive import BLOCK, E4M3_MAX
from .tile_configs import FP8TileConfig, dense_config
from .triton_act_quant import _pow2_ceil, _round_to_e4m3, quantize_rows_1x128_triton


@triton.jit
def _promote(acc, product, a_s, b_s, ONE_B_SCALE: tl.constexpr):
    """One K block's promotion: acc + product [BM, BN] x a_s [BM] x b_s (a scalar when ONE_B_SCALE, else [BN])."""
    if ONE_B_SCALE:
        acc += product * (a_s * b_s)[:, None]
    else:
        acc += product * (a_s[:, None] * b_s[None, :])
    return acc


@triton.jit
def fp8_block_dot(
    acc, a_ptrs, b_ptrs, a_scale_ptrs, b_scale_ptrs, K, kb_lo, kb_hi, s_ask, s_bsk,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_B_SCALE: tl.constexpr, PREFETCH_SCALES: tl.constexpr = False,
):  # fmt: skip
    """acc + sum over K blocks kb_lo <= kb < kb_hi of (A tile . B tile)(kb) * a_scale[:, kb] b_scale[:, kb]. The
    pointers address K block 0 at rows and columns already clamped into range: A tile [BM, BK], B tile [BK, BN],
    a_scale [BM], b_scale [BN] (a scalar pointer when ONE_B_SCALE).

    PREFETCH_SCALES (needs ONE_B_SCALE): the same sums in the same order, with each block's scales loaded two blocks
    ahead and their product formed one block ahead, so no iteration waits on a global load before its MMA."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs += kb_lo * BLOCK_K
    b_ptrs += kb_lo * BLOCK_K
    if PREFETCH_SCALES:
        tl.static_assert(ONE_B_SCALE, "prefetched scales need a tile in one weight-scale block")
        acc = _prefetched_block_dot(
            acc, a_ptrs, b_ptrs, a_scale_ptrs, b_scale_ptrs, K, kb_lo, kb_hi, s_ask, s_bsk, BLOCK_K, EVEN_K
        )
    else:
        for kb in range(kb_lo, kb_hi):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = ks < K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            a_s = tl.load(a_scale_ptrs + kb * s_ask)
            b_s = tl.load(b_scale_ptrs + kb * s_bsk)
            acc = _promote(acc, tl.dot(a, b), a_s, b_s, ONE_B_SCALE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    return acc


@triton.jit
def _prefetched_block_dot(
    acc, a_ptrs, b_ptrs, a_scale_ptrs, b_scale_ptrs, K, kb_lo, kb_hi, s_ask, s_bsk,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """`fp8_block_dot`'s loop for a scalar weight scale, with the scales off the MMA's critical path: a scale
    loaded in the iteration that uses it leaves the MMA's issue waiting on a global load (the compiler forms the
    scale product ahead of the MMA), which is most of the K loop's time at prefill shapes. Here block kb + 2's
    scales are loaded in iteration kb (indices clamped to the last block: extra loads, never read), and block kb +
    1's product a_scale * b_scale is formed at its end from the loads of iteration kb - 1. The products and the
    accumulation order are today's, so the result is bit-identical. (Carrying the raw scales two iterations
    instead would be a loop-carried distance of 2, which Triton's software pipeliner does not handle: it then
    drops the cp.async ring altogether.) Needs kb_lo < kb_hi: the launchers never start a K loop without blocks."""
    ks = tl.arange(0, BLOCK_K)
    s = tl.load(a_scale_ptrs + kb_lo * s_ask) * tl.load(b_scale_ptrs + kb_lo * s_bsk)
    k1 = tl.minimum(kb_lo + 1, kb_hi - 1)
    a_s1 = tl.load(a_scale_ptrs + k1 * s_ask)
    b_s1 = tl.load(b_scale_ptrs + k1 * s_bsk)
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        k2 = tl.minimum(kb + 2, kb_hi - 1)
        a_s2 = tl.load(a_scale_ptrs + k2 * s_ask)
        b_s2 = tl.load(b_scale_ptrs + k2 * s_bsk)
        acc += tl.dot(a, b) * s[:, None]
        s = a_s1 * b_s1
        a_s1 = a_s2
        b_s1 = b_s2
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _quantized_block_dot(
    acc, x_ptrs, b_ptrs, b_scale_ptrs, K, kb_lo, kb_hi, s_bsk,
    INV_MAX: tl.constexpr, UE8M0: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_B_SCALE: tl.constexpr,
):  # fmt: skip
    """`fp8_block_dot` with A read unquantized (x tile [BM, BK], any float) and quantized per 1x128 on the way in,
    exactly as `triton_act_quant._act_quant_kernel` does (the same amax, scale, IEEE division and rounding)."""
    ks = tl.arange(0, BLOCK_K)
    x_ptrs += kb_lo * BLOCK_K
    b_ptrs += kb_lo * BLOCK_K
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < K - kb * BLOCK_K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        amax = tl.max(tl.abs(x), axis=1)
        a_s = tl.where(amax > 0, amax * INV_MAX, 1.0)
        if UE8M0:
            a_s = _pow2_ceil(a_s)
        a = _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(a_s[:, None], x.shape))).to(tl.float8e4nv)
        b_s = tl.load(b_scale_ptrs + kb * s_bsk)
        acc = _promote(acc, tl.dot(a, b), a_s, b_s, ONE_B_SCALE)
        x_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K, kb_per_split,
    s_am, s_ask, s_bn, s_bsn, s_bsk, s_cs, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, FUSE_QUANT: tl.constexpr, UE8M0: tl.constexpr, INV_MAX: tl.constexpr,
    PREFETCH_SCALES: tl.constexpr = False,
):  # fmt: skip
    """A [M, K] (unit K stride): fp8 with a_scale K-block-major (row stride 1, K-block stride s_ask), or, when
    FUSE_QUANT, the unquantized activations (a_scale unused). B [N, K] fp8 (unit K stride), b_scale [ceil(N / 128),
    ceil(K / 128)]. Program (tile, split) sums K blocks [split * kb_per_split, (split + 1) * kb_per_split) into
    C[split] (split stride s_cs; one split: C itself)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows_in = rows % M  # clamped into range: no masks on the loads
    cols_in = cols % N
    a_ptrs = a_ptr + rows_in[:, None].to(tl.int64) * s_am + ks[None, :]
    b_ptrs = b_ptr + cols_in[None, :].to(tl.int64) * s_bn + ks[:, None]
    if BLOCK_K % BLOCK_N == 0:  # the tile lies in one weight-scale block
        b_scale_ptrs = b_scale_ptr + (pid_n * BLOCK_N // BLOCK_K) * s_bsn
    else:
        b_scale_ptrs = b_scale_ptr + (cols_in // BLOCK_K) * s_bsn
    kb_lo = split * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FUSE_QUANT:
        acc = _quantized_block_dot(acc, a_ptrs, b_ptrs, b_scale_ptrs, K, kb_lo, kb_hi, s_bsk, INV_MAX, UE8M0, BLOCK_K, EVEN_K, BLOCK_K % BLOCK_N == 0)
    else:
        acc = fp8_block_dot(acc, a_ptrs, b_ptrs, a_scale_ptr + rows_in, b_scale_ptrs, K, kb_lo, kb_hi, s_ask, s_bsk, BLOCK_K, EVEN_K, BLOCK_K % BLOCK_N == 0, PREFETCH_SCALES)
    c_ptrs = c_ptr + split.to(tl.int64) * s_cs + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _sum_partials_kernel(p_ptr, c_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """c[i] = sum over s < SPLIT of p[s, i] (fp32, in split order), for the flat [M * N] output."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def k_splits(config: FP8TileConfig, M: int, N: int, K: int) -> int:
    """How many programs share each output tile's K blocks: enough for the grid to reach the config's
    split_k_programs (1 when it is 0), at most one K block each."""
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    if not config.split_k_programs or tiles >= config.split_k_programs:
        return 1
    k_blocks = triton.cdiv(K, BLOCK)
    split = min(k_blocks, triton.cdiv(config.split_k_programs, tiles))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, split))  # no split left without K blocks


def _launch(a, a_scale_t, w8, w_scale, M, out_dtype, config, fuse_quant, ue8m0):
    K = a.shape[1]
    N = w8.shape[0]
    out = torch.empty(M, N, device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    split = k_splits(config, M, N, K)
    kb_per_split = triton.cdiv(triton.cdiv(K, BLOCK), split)
    target = out if split == 1 else torch.empty(split, M, N, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n), split)
    _fp8_gemm_kernel[grid](
        a, a if a_scale_t is None else a_scale_t, w8, w_scale, target, M, N, K, kb_per_split,
        a.stride(0), 0 if a_scale_t is None else a_scale_t.stride(0), w8.stride(0), w_scale.stride(0),
        w_scale.stride(1), target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK, GROUP_M=config.group_m,
        EVEN_K=K % BLOCK == 0, FUSE_QUANT=fuse_quant, UE8M0=ue8m0, INV_MAX=1.0 / E4M3_MAX,
        PREFETCH_SCALES=config.prefetch_scales and not fuse_quant,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        sum_block = 1024
        _sum_partials_kernel[(triton.cdiv(M * N, sum_block),)](target, out, M * N, SPLIT=split, BLOCK=sum_block)
    return out


def fp8_gemm_triton(
    x8: torch.Tensor,
    x_scale_t: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    M: int,
    out_dtype: torch.dtype,
    config: FP8TileConfig | None = None,
) -> torch.Tensor:
    """The first M rows of x8 [M_pad, K] (scales x_scale_t [ceil(K / 128), M_pad], `quantize_rows_1x128_triton`)
    times w8 [N, K]^T (scales w_scale [ceil(N / 128), ceil(K / 128)]) -> [M, N] in out_dtype, fp32 accumulation.
    Both fp8 operands need a unit K stride. config: the launch (default `dense_config(M, N)`; its fuse_quant is
    ignored here: x8 is quantized already)."""
    config = config or dense_config(M, w8.shape[0])
    return _launch(x8, x_scale_t, w8, w_scale, M, out_dtype, config, fuse_quant=False, ue8m0=False)


def fp8_linear_triton(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool, config: FP8TileConfig | None = None
) -> torch.Tensor:
    """x [M, K] (unit K stride; bf16/fp16/fp32) quantized per 1x128, times w8 [N, K]^T -> [M, N] in x's dtype: a
    separate quantization launch, or, where the config fuses it, none."""
    config = config or dense_config(x.shape[0], w8.shape[0])
    if config.fuse_quant:
        return _launch(x, None, w8, w_scale, x.shape[0], x.dtype, config, fuse_quant=True, ue8m0=ue8m0)
    x8, x_scale_t = quantize_rows_1x128_triton(x, ue8m0, 1)
    return _launch(x8, x_scale_t, w8, w_scale, x.shape[0], x.dtype, config, fuse_quant=False, ue8m0=False)
