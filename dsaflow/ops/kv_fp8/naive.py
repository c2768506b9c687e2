"""The FP8 cache rows' rounding in plain torch: the reference every kernel of the FP8 cache is tested against, and
what CPU serving runs, so a CPU run with serve.kv_dtype=fp8 sees the GPU's numbers.

A row (`Fp8RowFormat`): `width` values in blocks of `block`, one fp32 scale per block, `rope` trailing values in bf16.
    scale = amax(|block|) x (1 / 448) in fp32 (1 for a block of zeros; times the fp32 reciprocal, not a division,
            as `ops.indexer_topk.fp8.quantize_rows` and the kernels compute it)
    value = round-to-nearest-even(x / scale) in e4m3 (|x / scale| <= 448: never saturates)
    rope  = round-to-nearest-even(x) in bf16
The packed byte row is [values e4m3 | scales fp32 | rope bf16] (dsaflow.config.kv_cache_format).
Error bound per element, from e4m3's 3 mantissa bits: |x - x'| <= 2^-4 |x| for |x / scale| >= 2^-6 (normal
e4m3), and <= 2^-10 scale below that (subnormal e4m3 is a multiple of 2^-9); the rope part <= 2^-8 |x|.
"""

from __future__ import annotations

import torch

from dsaflow.config.kv_cache_format import Fp8RowFormat

E4M3_MAX = 448.0


def block_scales(values: torch.Tensor) -> torch.Tensor:
    """values [..., blocks, block] fp32 -> the fp32 scales [..., blocks]: amax x (1 / 448), 1 where amax is 0."""
    amax = values.abs().amax(dim=-1)
    return torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))


def quantize_fp8_rows(rows: torch.Tensor, fmt: Fp8RowFormat) -> torch.Tensor:
    """rows [..., width + rope] float -> the packed rows uint8 [..., fmt.nbytes]."""
    x = rows.detach().float()
    lead = x.shape[:-1]
    if x.shape[-1] != fmt.width + fmt.rope:
        raise ValueError(f"quantize_fp8_rows: rows of {x.shape[-1]} values for a format of {fmt.width} + {fmt.rope}")
    values = x[..., : fmt.width].reshape(*lead, fmt.blocks, fmt.block)
    scale = block_scales(values)
    e4m3 = (values / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(*lead, fmt.width)
    rope = x[..., fmt.width :].to(torch.bfloat16).contiguous()
    return torch.cat([e4m3.view(torch.uint8), scale.contiguous().view(torch.uint8), rope.view(torch.uint8)], dim=-1)


def unpack_fp8_rows(packed: torch.Tensor, fmt: Fp8RowFormat):
    """packed uint8 [..., nbytes] -> (values e4m3 [..., width], scales fp32 [..., blocks], rope bf16 [..., rope]),
    copies (any alignment)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != fmt.nbytes:
        raise ValueError(f"unpack_fp8_rows: {packed.dtype} rows of {packed.shape[-1]} bytes, not uint8 x {fmt.nbytes}")
    values = packed[..., : fmt.width].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., fmt.width : fmt.scale_end].contiguous().view(torch.float32)
    rope = packed[..., fmt.scale_end :].contiguous().view(torch.bfloat16)
    return values, scales, rope


def dequantize_fp8_rows(packed: torch.Tensor, fmt: Fp8RowFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., nbytes] -> rows [..., width + rope] in `dtype`: values x their block's scale, computed in
    fp32 (what the kernels multiply in registers), the rope part as stored."""
    values, scales, rope = unpack_fp8_rows(packed, fmt)
    lead = packed.shape[:-1]
    x = values.float().reshape(*lead, fmt.blocks, fmt.block) * scales.unsqueeze(-1)
    return torch.cat([x.reshape(*lead, fmt.width), rope.float()], dim=-1).to(dtype)


def write_fp8_rows_naive(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: Fp8RowFormat):
    """Quantize rows [B, T, width + rope] and scatter them into buffer uint8 [B', S, nbytes] (B <= B') at slots
    [B, T, 1] int64; returns buffer[:B]."""
    view = buffer[: rows.shape[0]]
    view.scatter_(1, slots.expand(-1, -1, fmt.nbytes), quantize_fp8_rows(rows, fmt))
    return view


def fp8_row_views(packed: torch.Tensor, fmt: Fp8RowFormat):
    """packed uint8 [..., nbytes] (unit last stride, 4-byte aligned rows) -> zero-copy typed views (values e4m3
    [..., width], scales fp32 [..., blocks], rope bf16 [..., rope]): what a kernel reads the rows through."""
    return (
        packed[..., : fmt.width].view(torch.float8_e4m3fn),
        packed[..., fmt.width : fmt.scale_end].view(torch.float32),
        packed[..., fmt.scale_end :].view(torch.bfloat16),
    )


def fp8_format_of(packed: torch.Tensor, width: int, rope: int) -> Fp8RowFormat | None:
    """The row format of a packed uint8 cache [..., nbytes] holding `width` e4m3 values (blocks of 128, or the
    whole width when narrower) and `rope` bf16 values; None if its bytes do not match (not a packed FP8 cache)."""
    fmt = Fp8RowFormat(width, min(128, width), rope)
    ok = packed.dtype == torch.uint8 and width % fmt.block == 0 and packed.shape[-1] == fmt.nbytes
    return fmt if ok else None
