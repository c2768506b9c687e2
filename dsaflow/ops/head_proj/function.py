"""Per-head latent projections as autograd Functions that never copy an activation (the strided-bmm kernel).

Every per-head product is one strided batched matmul over heads: a [B, T, H, D] activation seen as [H, B*T, D]
(batch stride D, row stride H * D) is a valid cuBLAS operand, and `torch.bmm(..., out=view)` writes through such a
view in place. So the absorbed query is written straight into q_abs[..., :C] with the rotated q_pe beside it in the
tail, the query gradient lands in one [B, T, H, N + R] buffer (no split / cat), and the output projection's backward
hands the attention backward a contiguous [B, T, H, C] gradient. Weight gradients are strided bmm's too.

Weights come in already in the compute dtype (cast outside, so autograd casts their gradients back under autocast).
"""

from __future__ import annotations

import torch

from dsaflow.ops.rope import rope_into

_empty = torch.empty  # every output buffer comes from here (the tests poison it with NaN)


def _heads(a: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [H, B*T, D] view (copies only if B and T cannot be merged or the last dim is strided)."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    return a.flatten(0, 1).transpose(0, 1)


class AbsorbQuery(torch.autograd.Function):
    """q [B, T, H, N + R], w_uk [H, N, C], cos/sin [B, T, R // 2] -> q_abs [B, T, H, C + R]; differentiable in q
    and w_uk."""

    @staticmethod
    def forward(ctx, q, w_uk, cos, sin):
        B, T, H, D = q.shape
        N, C = w_uk.shape[1], w_uk.shape[2]
        q_abs = _empty((B, T, H, C + D - N), device=q.device, dtype=q.dtype)
        torch.bmm(_heads(q[..., :N]), w_uk, out=_heads(q_abs[..., :C]))
        rope_into(q[..., N:], cos, sin, q_abs[..., C:])
        ctx.save_for_backward(q, w_uk, cos, sin)
        return q_abs

    @staticmethod
    def backward(ctx, g):
        q, w_uk, cos, sin = ctx.saved_tensors
        N, C = w_uk.shape[1], w_uk.shape[2]
        g = g if g.stride(-1) == 1 else g.contiguous()
        dq = dw = None
        if ctx.needs_input_grad[0]:
            dq = _empty(q.shape, device=q.device, dtype=q.dtype)
            torch.bmm(_heads(g[..., :C]), w_uk.transpose(1, 2), out=_heads(dq[..., :N]))
            rope_into(g[..., C:], cos, sin, dq[..., N:], inverse=True)
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(_heads(q[..., :N]).transpose(1, 2), _heads(g[..., :C]))
        return dq, dw, None, None


class HeadOutput(torch.autograd.Function):
    """o_lat [B, T, H, C], w_uv [H, V, C] -> [B, T, H * V]; differentiable in both."""

    @staticmethod
    def forward(ctx, o_lat, w_uv):
        B, T, H, _ = o_lat.shape
        V = w_uv.shape[1]
        out = _empty((B, T, H * V), device=o_lat.device, dtype=o_lat.dtype)
        torch.bmm(_heads(o_lat), w_uv.transpose(1, 2), out=_heads(out.view(B, T, H, V)))
        ctx.save_for_backward(o_lat, w_uv)
        return out

    @staticmethod
    def backward(ctx, g):
        o_lat, w_uv = ctx.saved_tensors
        B, T, H, C = o_lat.shape
        g = g if g.stride(-1) == 1 else g.contiguous()
        g_heads = _heads(g.reshape(B, T, H, w_uv.shape[1]))
        do = dw = None
        if ctx.needs_input_grad[0]:
            do = _empty((B, T, H, C), device=o_lat.device, dtype=o_lat.dtype)
            torch.bmm(g_heads, w_uv, out=_heads(do))
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(g_heads.transpose(1, 2), _heads(o_lat))
        return do, dw
