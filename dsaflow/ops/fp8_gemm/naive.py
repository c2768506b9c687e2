"""fp32 references of DeepSeek's FP8 recipe: activations quantized per 1x128 (one scale per row per 128 columns),
weights per 128x128 block, both to e4m3; the GEMMs dequantize both and multiply in fp32.

A scale is what the block is multiplied by to get back its real values (`weight_scale_inv` in DeepSeek-V3/V3.2
checkpoints): real ~= x8.float() * scale. A block's scale is amax / 448 (e4m3's largest finite value), times the fp32
reciprocal rather than a division, which torch computes the same way on CPU and CUDA and the kernels reproduce bit
for bit; a block of zeros gets scale 1. With `ue8m0` the scale is rounded up to a power of two (DeepSeek-V3.2's
`scale_fmt: ue8m0`), so dividing by it is exact and only the e4m3 rounding remains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # the recipe's block edge: 1x128 for activations, 128x128 for weights
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def blocks(n: int) -> int:
    """How many 128-wide blocks cover n columns (the last one may be partial)."""
    return -(-n // BLOCK)


def power_of_two_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive fp32 scale, from its bits: keep the exponent, and step it up by
    one where any mantissa bit is set. Exact, and what the kernels compute."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    return torch.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent).view(torch.float32)


def block_scale(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """fp32 scale of blocks whose largest magnitude is `amax`: amax / 448 (1 for an all-zero block), rounded up to
    a power of two when `ue8m0`."""
    amax = amax.float()
    scale = torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))
    return power_of_two_ceil(scale) if ue8m0 else scale


def quantize_rows_1x128(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations to e4m3 with one scale per row per 128 columns.

    Args:
        x: [..., K] float.
        ue8m0: power-of-two scales.

    Returns:
        x8: float8_e4m3fn [..., K].
        scale: fp32 [..., ceil(K / 128)], x ~= x8.float() * scale repeated over each block's columns.
    """
    K = x.shape[-1]
    KB = blocks(K)
    xf = F.pad(x.float(), (0, KB * BLOCK - K)).reshape(*x.shape[:-1], KB, BLOCK)
    scale = block_scale(xf.abs().amax(dim=-1), ue8m0)
    x8 = (xf / scale.unsqueeze(-1)).to(FP8).reshape(*x.shape[:-1], KB * BLOCK)[..., :K]
    return x8.contiguous(), scale


def dequantize_rows_1x128(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x8 [..., K], scale [..., ceil(K / 128)] -> the fp32 values [..., K] they stand for."""
    K = x8.shape[-1]
    return x8.float() * scale.float().repeat_interleave(BLOCK, dim=-1)[..., :K]


def quantize_blocks_128(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights to e4m3 with one scale per 128x128 block (DeepSeek-V3's `weight` + `weight_scale_inv`).

    Args:
        w: [..., N, K] float: one weight [N, K], or an expert stack [E, N, K].
        ue8m0: power-of-two scales.

    Returns:
        w8: float8_e4m3fn [..., N, K].
        scale: fp32 [..., ceil(N / 128), ceil(K / 128)], w ~= `dequantize_blocks_128(w8, scale)`.
    """
    N, K = w.shape[-2:]
    NB, KB = blocks(N), blocks(K)
    wf = F.pad(w.float(), (0, KB * BLOCK - K, 0, NB * BLOCK - N))
    wf = wf.reshape(*w.shape[:-2], NB, BLOCK, KB, BLOCK)
    scale = block_scale(wf.abs().amax(dim=(-3, -1)), ue8m0)  # [..., NB, KB]
    w8 = (wf / scale[..., :, None, :, None]).to(FP8).reshape(*w.shape[:-2], NB * BLOCK, KB * BLOCK)
    return w8[..., :N, :K].contiguous(), scale


def dequantize_blocks_128(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8 [..., N, K], scale [..., ceil(N / 128), ceil(K / 128)] -> the fp32 weight [..., N, K]."""
    N, K = w8.shape[-2:]
    full = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return w8.float() * full[..., :N, :K]


def fp8_linear_naive(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x quantized per 1x128 (`quantize_rows_1x128`), both operands
    dequantized, one fp32 matmul with w8 [N, K] (scales w_scale [ceil(N / 128), ceil(K / 128)]) transposed."""
    return fp8_linear_quantized_naive(*quantize_rows_1x128(x, ue8m0), w8, w_scale, x.dtype)


def fp8_linear_quantized_naive(
    x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`fp8_linear_naive` of activations already quantized: x8 e4m3 [..., K] with scales [..., ceil(K / 128)]
    (`quantize_rows_1x128`'s pair) -> [..., N] in out_dtype."""
    xq = dequantize_rows_1x128(x8, x_scale)
    return (xq @ dequantize_blocks_128(w8, w_scale).t()).to(out_dtype)


def fp8_grouped_mm_naive(
    a: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, offsets: torch.Tensor, ue8m0: bool = False
) -> torch.Tensor:
    """a [M, K] (rows sorted by expert), w8 [E, N, K] with scales [E, ceil(N / 128), ceil(K / 128)], offsets int32
    [E] (cumulative row ends) -> [M, N] in a's dtype: row m of expert e is `fp8_linear_naive(a[m], w8[e], ...)`;
    rows past offsets[-1] belong to no expert and are zero. One expert at a time (the ends are read on the host)."""
    return fp8_grouped_mm_quantized_naive(*quantize_rows_1x128(a, ue8m0), w8, w_scale, offsets, a.dtype)


def fp8_grouped_mm_quantized_naive(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`fp8_grouped_mm_naive` of rows already quantized: x8 e4m3 [M, K] with scales [M, ceil(K / 128)] -> [M, N]
    in out_dtype."""
    aq = dequantize_rows_1x128(x8, x_scale)
    out = torch.zeros(x8.shape[0], w8.shape[1], device=x8.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = aq[start:end] @ dequantize_blocks_128(w8[e], w_scale[e]).t()
        start = end
    return out.to(out_dtype)
