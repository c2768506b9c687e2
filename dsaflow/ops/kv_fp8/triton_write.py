"""Quantize-and-write of FP8 cache rows in one kernel: rows [B, T, width + rope] (the layer's fresh latent rows or
indexer keys) -> their packed bytes at their cache slots. One program per (token, part): parts 0 .. blocks - 1 each
take one block of values (amax, scale, e4m3 bytes), the last part the rope values (bf16).

The e4m3 byte is built with integer arithmetic from the fp32 bits (`_e4m3_bits`) rather than by a float8 cast:
round-to-nearest-even exactly as torch's conversion (`naive.quantize_fp8_rows`), the same on every GPU and in the
Triton interpreter, whose float8 cast is not exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaflow.config.kv_cache_format import Fp8RowFormat

from .naive import fp8_row_views


@triton.jit
def _e4m3_bits(y):
    """y fp32, |y| <= 448 -> int32 holding the e4m3fn byte of round-to-nearest-even(y) (sign bit kept, as torch)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    mag_bits = a.to(tl.int32, bitcast=True)
    # normal e4m3 (|y| >= 2^-6): keep 3 of the 23 mantissa bits, nearest even; a carry moves into the exponent.
    # (exponent << 3 | mantissa) then loses the bias difference 127 - 7.
    rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # subnormal e4m3 (|y| < 2^-6): multiples of 2^-9, i.e. round y * 512 (exact, < 8) to an integer, ties to even
    m = a * 512.0
    whole = m.to(tl.int32)
    frac = m - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = whole + up.to(tl.int32)
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def _write_fp8_rows_kernel(
    x_ptr, slot_ptr, vals_ptr, scale_ptr, rope_ptr,
    T, R, n_parts,
    s_xb, s_xt, s_sb, s_st,
    s_vb, s_vs, s_cb, s_cs, s_rb, s_rs,
    WIDTH: tl.constexpr, QB: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    token = pid // n_parts
    part = (pid % n_parts).to(tl.int32)
    b = token // T
    t = token % T
    slot = tl.load(slot_ptr + b * s_sb + t * s_st).to(tl.int64)
    x_row = x_ptr + b * s_xb + t * s_xt
    if part < WIDTH // QB:
        offs = tl.arange(0, BLOCK_Q)
        ok = offs < QB
        x = tl.load(x_row + part * QB + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)  # naive.E4M3_MAX, times its fp32 reciprocal
        y = tl.math.div_rn(x, tl.full([BLOCK_Q], 1.0, tl.float32) * scale)
        byte = _e4m3_bits(y).to(tl.uint8)
        tl.store(vals_ptr + b * s_vb + slot * s_vs + part * QB + offs, byte, mask=ok)
        tl.store(scale_ptr + b * s_cb + slot * s_cs + part, scale)
    else:
        offs = tl.arange(0, BLOCK_R)
        ok = offs < R
        x = tl.load(x_row + WIDTH + offs, mask=ok, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)  # bf16, nearest even, by hand: the interpreter's cast truncates
        half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(rope_ptr + b * s_rb + slot * s_rs + offs, half.to(tl.int16), mask=ok)


def write_fp8_rows_triton(
    buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: Fp8RowFormat
) -> torch.Tensor:
    """`naive.write_fp8_rows_naive` in one launch: rows [B, T, width + rope] (unit last stride), slots [B, T, 1]
    int64, buffer uint8 [B', S, nbytes] with B <= B' (unit last stride, rows 4-byte aligned) -> buffer[:B]."""
    B, T, _ = rows.shape
    view = buffer[:B]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    _, scales, rope = fp8_row_views(view, fmt)
    vals = view  # the e4m3 bytes are built as integers and stored as uint8 at offsets [0, width)
    n_parts = fmt.blocks + (1 if fmt.rope else 0)
    if B * T:
        rope_t = rope.view(torch.int16) if fmt.rope else scales  # bf16 bits; any tensor when there is no rope
        _write_fp8_rows_kernel[(B * T * n_parts,)](
            rows, slots, vals, scales, rope_t,
            T, fmt.rope, n_parts,
            rows.stride(0), rows.stride(1), slots.stride(0), slots.stride(1),
            vals.stride(0), vals.stride(1), scales.stride(0), scales.stride(1), rope_t.stride(0), rope_t.stride(1),
            WIDTH=fmt.width, QB=fmt.block, BLOCK_Q=triton.next_power_of_2(fmt.block),
            BLOCK_R=triton.next_power_of_2(max(fmt.rope, 1)), num_warps=1,
        )
    return view
