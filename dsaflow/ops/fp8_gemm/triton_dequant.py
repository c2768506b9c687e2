"""Block-scaled e4m3 weights back to a float matrix, in one Triton pass: what MLA's absorbed attention needs of an
FP8 kv_b projection at every call (W_UK, W_UV as plain per-head matrices, `dsaflow.model.fp8_weights.matrix_weight`).

One program converts one 128x128 block: it reads the block's e4m3 bytes and its one fp32 scale and writes
e4m3 -> fp32 times the scale (an IEEE fp32 product), rounded to the output dtype: the same two roundings as
`naive.dequantize_blocks_128(w8, scale).to(dtype)`, so the two are bit-equal. It moves
1 byte in and 2 out per element (bf16), where the torch expression's three passes (to fp32, scale, cast) move 15.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import BLOCK, FP8, blocks


@triton.jit
def _round_to_bf16(y):
    """fp32 -> bf16 rounded to nearest, ties to even, in integer bits: the GPU's cast does the same, and Triton's CPU
    interpreter's cast truncates. Finite inputs (a weight times its scale)."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_we, s_wn, s_se, s_sn, s_oe, s_on, KB, BLOCK: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)  # the stack index (0 for a plain matrix)
    nb = tl.program_id(0) // KB
    kb = tl.program_id(0) % KB
    rows = nb * BLOCK + tl.arange(0, BLOCK)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + e * s_we + rows[:, None].to(tl.int64) * s_wn + cols[None, :], mask=m, other=0.0)
    scale = tl.load(s_ptr + e * s_se + nb * s_sn + kb)
    out = w.to(tl.float32) * scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_to_bf16(out)
    else:
        out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + e * s_oe + rows[:, None].to(tl.int64) * s_on + cols[None, :], out, mask=m)


def dequantize_blocks_128_triton(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w8 float8_e4m3fn [..., N, K] (last dim contiguous), scale fp32 [..., ceil(N/128), ceil(K/128)] -> a new
    [..., N, K] in `dtype`, bit-equal to `dequantize_blocks_128(w8, scale).to(dtype)`. Graph-safe (shapes only)."""
    if w8.dtype != FP8 or w8.dim() < 2 or w8.stride(-1) != 1:
        raise ValueError(f"dequantize: w8 must be float8_e4m3fn [..., N, K] with a contiguous last dim, got "
                         f"{w8.dtype} {tuple(w8.shape)} strides {w8.stride()}")
    N, K = w8.shape[-2:]
    NB, KB = blocks(N), blocks(K)
    if tuple(scale.shape) != (*w8.shape[:-2], NB, KB) or scale.dtype != torch.float32:
        raise ValueError(f"dequantize: scale must be fp32 {(*w8.shape[:-2], NB, KB)}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    w3 = w8.reshape(-1, N, K)
    s3 = scale.reshape(-1, NB, KB)
    if s3.stride(-1) != 1:
        s3 = s3.contiguous()
    out = torch.empty(w3.shape, device=w8.device, dtype=dtype)
    if out.numel():
        _dequant_kernel[(NB * KB, w3.shape[0])](
            w3, s3, out, N, K, w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), out.stride(0), out.stride(1),
            KB, BLOCK=BLOCK, num_warps=8,
        )
    return out.view(w8.shape)
