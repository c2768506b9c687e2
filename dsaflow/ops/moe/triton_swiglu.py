"""The experts' activation with the routing weight folded in, fused in Triton, forward and backward:
act[m] = w[m] * silu(gate[m]) * up[m] over h = [gate | up] of the rows sorted by expert. One pass over h instead of
the chunk / silu / multiply / weigh chain (each a full read and write of [M, I] or [M, D] tensors), fp32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(h_ptr, w_ptr, out_ptr, I, s_h, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(h_ptr + row * s_h + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * s_h + I + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row).to(tl.float32)
    act = g * tl.sigmoid(g) * u * w
    tl.store(out_ptr + row * s_o + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, w_ptr, d_ptr, dh_ptr, dw_ptr, I, s_h, s_d, s_dh, BLOCK: tl.constexpr):
    """One row: d_gate, d_up [I] and d_w = sum over the row of silu(g) * u * d (looped over I)."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(w_ptr + row).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, I, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < I
        g = tl.load(h_ptr + row * s_h + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * s_h + I + cols, mask=ok, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * s_d + cols, mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dw += silu * u * d
        d_silu = sig * (1.0 + g * (1.0 - sig))
        tl.store(dh_ptr + row * s_dh + cols, (d * w * u * d_silu).to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(dh_ptr + row * s_dh + I + cols, (d * w * silu).to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + row, tl.sum(dw, axis=0))


def swiglu_weighted_fwd(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h [M, 2I] (rows contiguous), w [M] fp32 -> act [M, I] in h's dtype."""
    M, I = h.shape[0], h.shape[1] // 2
    out = torch.empty(M, I, device=h.device, dtype=h.dtype)
    if M:
        block = min(1024, triton.next_power_of_2(I))
        _swiglu_fwd_kernel[(M, triton.cdiv(I, block))](h, w, out, I, h.stride(0), out.stride(0), BLOCK=block)
    return out


def swiglu_weighted_bwd(h: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2I], w [M] fp32, d [M, I] (act's gradient) -> (dh [M, 2I] in h's dtype, dw [M] fp32)."""
    M, I = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    dw = torch.empty(M, device=h.device, dtype=torch.float32)
    if M:
        block = min(1024, triton.next_power_of_2(I))
        _swiglu_bwd_kernel[(M,)](h, w, d, dh, dw, I, h.stride(0), d.stride(0), dh.stride(0), BLOCK=block)
    return dh, dw
