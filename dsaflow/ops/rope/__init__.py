"""Rotary position embedding (half-split convention). CUDA tensors use the Triton kernel, CPU tensors the fp32 torch
reference; both compute the rotation in fp32 and return x's dtype. A CUDA input the kernel refuses raises."""

from __future__ import annotations

import torch

from .naive import rope_into_naive, rope_naive


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor:
    """x [B, T, d] or [B, T, H, d]; cos/sin [B, T, rope_dim // 2] fp32 (`dsaflow.model.rope.rope_angles`) -> x with
    its first rope_dim dims (default all d) rotated, the rest unchanged. Same shape and dtype as x."""
    if x.is_cuda:
        from .triton_rope import rope_triton

        return rope_triton(x, cos, sin, rope_dim)
    return rope_naive(x, cos, sin, rope_dim)


def rope_into(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """No autograd: write the rotation of x (all of its last dim; by -angle if inverse) into out (same shape, any
    strides, e.g. a view into a larger buffer) and return out."""
    if x.is_cuda:
        from .triton_rope import rope_into as rope_into_triton

        return rope_into_triton(x, cos, sin, out, inverse=inverse)
    return rope_into_naive(x, cos, sin, out, inverse)


__all__ = ["rope", "rope_into", "rope_naive", "rope_into_naive"]
