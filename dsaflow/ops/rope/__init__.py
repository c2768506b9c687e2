"""Rotary position embedding (half-split convention).

Layout: `naive.py` (fp32 reference), the kernel (`triton_rope.py`: strided in, strided out), the autograd.Function
(`function.py`), the dispatch table (`dispatch.py`, `explain_rope`), and the public `rope` and `rope_into` below.
Both paths compute the rotation in fp32 and return x's dtype.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_rope
from .naive import rope_into_naive, rope_naive


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor:
    """Rotate the first rope_dim dims of each row of x by the angles of its position.

    Args:
        x: [B, T, d] or [B, T, H, d] (bf16/fp16/fp32 on CUDA); every head of a (b, t) row gets the same angles.
        cos, sin: [B, T, rope_dim // 2] fp32 (`dsaflow.model.rope.rope_angles`).
        rope_dim: how many leading dims rotate (even; default all d); the rest pass through unchanged.

    Returns:
        x's shape and dtype, rotated. Differentiable in x. The kernel is chosen by `dispatch.py`
        (`explain_rope(...)`); a CUDA input no kernel takes raises ValueError.
    """
    rope_dim = x.shape[-1] if rope_dim is None else rope_dim
    kernel = chosen("rope", explain_rope(x, cos, sin, rope_dim), describe(x=x, cos=cos, sin=sin))
    if kernel == "reference":
        return rope_naive(x, cos, sin, rope_dim)
    if kernel == "identity":
        return x
    from .function import rope_triton

    return rope_triton(x, cos, sin, rope_dim)


def rope_into(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """No autograd: write the rotation of x into out (the building block of the head projections' Functions).

    Args:
        x: [B, T, d] or [B, T, H, d]; all of its last dim rotates.
        cos, sin: [B, T, d // 2] fp32.
        out: x's shape, any strides with a contiguous last dim (e.g. a view into a larger buffer).
        inverse: rotate by -angle (the gradient of the rotation).

    Returns:
        out.
    """
    kernel = chosen("rope_into", explain_rope(x, cos, sin, out=out), describe(x=x, cos=cos, sin=sin, out=out))
    if kernel == "reference":
        return rope_into_naive(x, cos, sin, out, inverse)
    from .triton_rope import rope_into as rope_into_triton

    return rope_into_triton(x, cos, sin, out, inverse=inverse)


__all__ = ["explain_rope", "rope", "rope_into", "rope_naive", "rope_into_naive"]
