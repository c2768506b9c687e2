"""Activations to e4m3 per 1x128 block, in Triton: the GEMMs' first pass, bit-equal to `naive.quantize_rows_1x128`.

One program quantizes BLOCK_ROWS rows x one 128-column block: the block's amax, its scale (amax times the fp32
reciprocal of 448, as the reference computes it; a power of two when UE8M0), then each value divided by the scale
with IEEE rounding (`div_rn`: Triton's plain `/` is approximate on the GPU) and rounded to e4m3.

The rounding to e4m3 is done in fp32 bits before the cast, which then only converts an exact value. The result is
the same round-half-to-even the hardware cast would give, and it is also what Triton's CPU interpreter needs: its
fp32 -> e4m3 cast is wrong where rounding carries into the exponent (triton 3.9 gives 64 for 127.2).

The scales are written K-block-major, scale_t [ceil(K / 128), M_pad]: the GEMM tiles read one contiguous run of
rows per K block, and scale_t.t() is the outer-dim-major [M_pad, ceil(K / 128)] that torch's block-scaled
`scaled_mm` takes. M_pad rounds M up to `pad_rows` (cuBLASLt wants the scale columns 16-byte aligned); the padding
rows are zeros with scale 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import BLOCK, E4M3_MAX, FP8, blocks


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448 up to rounding) to the nearest e4m3 value, ties to even, still in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range (|y| >= 2^-6): keep 3 of the 23 mantissa bits, rounding the 20 dropped ones half to even; a carry
    # out of the mantissa steps the exponent, as it should
    keep = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + keep) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = 0xFFF00000
    # subnormal range: e4m3's step there is 2^-9; adding 1.5 * 2^14 puts the fp32 rounding point at exactly that step
    mag = tl.abs(y)
    sub = (mag + 24576.0) - 24576.0
    sub = (sub.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # y's sign back
    return tl.where(mag < 0.015625, sub, normal)


@triton.jit
def _pow2_ceil(s):
    """The smallest power of two >= s > 0 (as naive.power_of_two_ceil)."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    return tl.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent).to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_kernel(
    x_ptr, x8_ptr, scale_ptr,
    M, M_pad, K,
    s_xm, s_x8m,
    INV_MAX: tl.constexpr, UE8M0: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    kb = tl.program_id(1)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax * INV_MAX, 1.0)
    if UE8M0:
        scale = _pow2_ceil(scale)
    # div_rn does not broadcast (it lowers straight to one precise division of equal shapes)
    y = _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (BLOCK_ROWS, BLOCK_K))))
    pad_ok = rows < M_pad
    tl.store(x8_ptr + rows[:, None].to(tl.int64) * s_x8m + cols[None, :], y.to(tl.float8e4nv), mask=pad_ok[:, None] & col_ok[None, :])
    tl.store(scale_ptr + kb.to(tl.int64) * M_pad + rows, scale, mask=pad_ok)


def quantize_rows_1x128_triton(
    x: torch.Tensor, ue8m0: bool = False, pad_rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride, any row stride; bf16/fp16/fp32) -> (x8 float8_e4m3fn [M_pad, K],
    scale_t fp32 [ceil(K / 128), M_pad]), M_pad = M rounded up to a multiple of pad_rows. Rows < M equal
    `naive.quantize_rows_1x128(x)` bit for bit: x8[:M] and scale_t.t()[:M]."""
    M, K = x.shape
    M_pad = -(-M // pad_rows) * pad_rows
    x8 = torch.empty(M_pad, K, device=x.device, dtype=FP8)
    scale_t = torch.empty(blocks(K), M_pad, device=x.device, dtype=torch.float32)
    if M_pad == 0 or K == 0:
        return x8, scale_t
    block_rows = 32
    grid = (triton.cdiv(M_pad, block_rows), blocks(K))
    _act_quant_kernel[grid](
        x, x8, scale_t, M, M_pad, K, x.stride(0), x8.stride(0),
        INV_MAX=1.0 / E4M3_MAX, UE8M0=ue8m0, BLOCK_ROWS=block_rows, BLOCK_K=BLOCK, num_warps=4,
    )  # fmt: skip
    return x8, scale_t
