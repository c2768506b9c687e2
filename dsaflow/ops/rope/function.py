"""`RopeFunction`: the differentiable rotation through the Triton kernel (the backward is the rotation by -angle)."""

from __future__ import annotations

import torch

from .triton_rope import rope_into

_empty_like = torch.empty_like  # every output buffer comes from here (the tests poison it with NaN)


class RopeFunction(torch.autograd.Function):
    """Differentiable in x only (cos/sin come from integer positions)."""

    @staticmethod
    def forward(ctx, x, cos, sin, rope_dim: int):
        ctx.save_for_backward(cos, sin)
        ctx.rope_dim = rope_dim
        return rope_into(x, cos, sin, _empty_like(x, memory_format=torch.contiguous_format), rope_dim)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        dx = rope_into(g, cos, sin, _empty_like(g, memory_format=torch.contiguous_format), ctx.rope_dim, inverse=True)
        return dx, None, None, None


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Same contract as `naive.rope_naive` for 0 < rope_dim; raises ValueError for inputs the kernel refuses."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return RopeFunction.apply(x, cos, sin, rope_dim)
