"""Triton RoPE (half-split convention of `naive.rope_naive`): strided in, strided out, fp32 math.

Reading and writing through strides lets MLA rotate q_pe straight into the tail of the absorbed query q_abs (and its
gradient into the tail of dq) with no copy; the indexer's prefix rope rotates the first dims and copies the rest in
the same pass. The backward is the same kernel with the angle negated (`function.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DIM = 1024  # one program holds BLOCK_H rows of the head dim


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, T, H, HALF, PASS,
    s_xb, s_xt, s_xh, s_ob, s_ot, s_oh, s_cb, s_ct, s_sb, s_st,
    SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # One program: one (b, t) row, BLOCK_H heads. The angle is shared by all heads of the row.
    row = tl.program_id(0)
    b = row // T
    t = row % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    hm = h < H
    im = i < HALF
    c = tl.load(cos_ptr + b * s_cb + t * s_ct + i, mask=im, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * s_sb + t * s_st + i, mask=im, other=0.0).to(tl.float32) * SIGN
    x_row = x_ptr + b.to(tl.int64) * s_xb + t.to(tl.int64) * s_xt + h.to(tl.int64)[:, None] * s_xh
    o_row = out_ptr + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot + h.to(tl.int64)[:, None] * s_oh
    m = hm[:, None] & im[None, :]
    x1 = tl.load(x_row + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(o_row + i[None, :], o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(o_row + HALF + i[None, :], o2.to(out_ptr.dtype.element_ty), mask=m)
    if BLOCK_PASS > 0:  # dims past the rotary prefix pass through unchanged
        p = tl.arange(0, BLOCK_PASS)
        pm = hm[:, None] & (p < PASS)[None, :]
        v = tl.load(x_row + 2 * HALF + p[None, :], mask=pm, other=0.0)
        tl.store(o_row + 2 * HALF + p[None, :], v.to(out_ptr.dtype.element_ty), mask=pm)


def rope_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> str | None:
    """None if the kernel takes these inputs, else why not."""
    if x.dim() not in (3, 4):
        return f"x of shape {tuple(x.shape)} (expected [B, T, d] or [B, T, H, d])"
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (bf16/fp16/fp32)"
    B, T, d = x.shape[0], x.shape[1], x.shape[-1]
    if rope_dim % 2 or not 0 < rope_dim <= d or d > MAX_DIM:
        return f"rope_dim={rope_dim} of d={d} (even, 0 < rope_dim <= d <= {MAX_DIM})"
    for name, a in (("cos", cos), ("sin", sin)):
        if tuple(a.shape) != (B, T, rope_dim // 2) or not a.is_floating_point():
            return f"{name} of shape {tuple(a.shape)} {a.dtype} (expected float [{B}, {T}, {rope_dim // 2}])"
    return None


def _as4(a: torch.Tensor) -> torch.Tensor:
    return a.unsqueeze(2) if a.dim() == 3 else a


def rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, rope_dim: int | None = None,
              inverse: bool = False) -> torch.Tensor:
    """Launcher. x, out [B, T, d] or [B, T, H, d] (same shape, any strides with the last dim contiguous; out may be a
    view into a larger buffer); cos/sin [B, T, rope_dim // 2]. Writes the rotated x (first rope_dim dims, the rest
    copied) into out and returns out. inverse=True rotates by -angle (the backward)."""
    d = x.shape[-1]
    rope_dim = d if rope_dim is None else rope_dim
    reason = rope_supports(x, cos, sin, rope_dim)
    if reason is None and (out.shape != x.shape or x.stride(-1) != 1 or out.stride(-1) != 1
                           or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        reason = f"out {tuple(out.shape)} for x {tuple(x.shape)}, or a last dim that is not contiguous"
    if reason is not None:
        raise ValueError(f"rope (Triton): {reason}")
    if x.numel() == 0:
        return out
    x4, o4 = _as4(x), _as4(out)
    B, T, H = x4.shape[0], x4.shape[1], x4.shape[2]
    half, n_pass = rope_dim // 2, d - rope_dim
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_half))
    grid = (B * T, triton.cdiv(H, block_h))
    _rope_kernel[grid](
        x4, o4, cos, sin, T, H, half, n_pass,
        x4.stride(0), x4.stride(1), x4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        SIGN=-1.0 if inverse else 1.0, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(n_pass) if n_pass else 0, num_warps=4 if block_h * block_half >= 512 else 1,
    )
    return out
