"""fp32 reference for rotary position embedding (half-split / GPT-NeoX convention).

A rotary vector of `2 * half` dims is split into halves x = [x1 | x2] and rotated pairwise (x1[i], x2[i]) by the angle
whose cosine and sine are cos[..., i], sin[..., i]: out = [x1 cos - x2 sin | x2 cos + x1 sin]. Only the first
`rope_dim` dims of a row are rotated; the rest pass through unchanged. The inverse (the backward) rotates by -angle.
"""

from __future__ import annotations

import torch


def _broadcast(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if x.dim() == 4:  # [B, T, H, d]: one angle per (b, t), shared by all heads
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return cos, sin


def rope_naive(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor:
    """x [B, T, d] or [B, T, H, d]; cos/sin [B, T, rope_dim // 2] (fp32) -> x with its first rope_dim dims rotated
    (rope_dim defaults to d). Same shape and dtype as x; the rotation is computed in fp32. Differentiable (autograd)."""
    d = x.shape[-1]
    rope_dim = d if rope_dim is None else rope_dim
    cos, sin = _broadcast(x, cos, sin)
    x1, x2 = x[..., :rope_dim].float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rope_dim == d:
        return rotated
    return torch.cat([rotated, x[..., rope_dim:]], dim=-1)


def rope_into_naive(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Write the rotation of x (all of its last dim) into `out` (same shape, any strides); inverse=True rotates by
    -angle (the gradient of the rotation). No autograd: the building block of autograd Functions on CPU."""
    out.copy_(rope_naive(x, cos, -sin if inverse else sin))
    return out
