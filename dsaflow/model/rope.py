"""Rotary position embedding, half-split (GPT-NeoX) convention.

A rotary vector of `d` dims is split into halves x = [x1 | x2] and rotated pairwise (x1[i], x2[i]) by angle
pos * theta^(-2i/d): out = [x1 cos - x2 sin | x2 cos + x1 sin]. MLA applies it to the whole `qk_rope_head_dim`
part of q and k; the indexer to the first `index_rope_head_dim` dims of its q and k.
"""

from __future__ import annotations

import torch

from dsaflow.ops.rope import rope


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] int -> (cos, sin) each [B, T, dim // 2] fp32. Negative (padding) positions use 0."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.clamp(min=0).float().unsqueeze(-1) * inv_freq
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, d] or [B, T, H, d]; cos/sin [B, T, d // 2] -> rotated x, same shape and dtype (math in fp32).
    CUDA tensors run the Triton kernel, CPU tensors the torch reference (`dsaflow.ops.rope`)."""
    return rope(x, cos, sin)


def apply_rope_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate only the first `rope_dim` dims of x [..., d] (the indexer convention); the rest pass through."""
    return rope(x, cos, sin, rope_dim)
