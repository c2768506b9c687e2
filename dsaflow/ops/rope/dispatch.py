"""Which RoPE kernel runs a call: one table of (kernel, capability rule), walked by `explain_rope`.

| kernel        | runs when                                                                                  |
|---------------|--------------------------------------------------------------------------------------------|
| `reference`   | CPU tensors (`naive.py`, fp32 math; autograd differentiates it)                            |
| `identity`    | `rope` with rope_dim 0 (index_rope_head_dim=0): nothing rotates, x is returned             |
| `triton_rope` | bf16/fp16/fp32 x of [B, T, d] or [B, T, H, d], even 0 < rope_dim <= d <= 1024, cos/sin      |
|               | float [B, T, rope_dim // 2] (`triton_rope.rope_supports`)                                   |

A CUDA call no kernel takes raises ValueError with the shapes and every candidate's reason.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk


def _reference_rule(x, cos, sin, rope_dim, out):
    return f"device {x.device.type} runs the kernel" if x.is_cuda else None


def _identity_rule(x, cos, sin, rope_dim, out):
    if out is not None:
        return "rope_into writes out"
    return None if rope_dim == 0 else f"rope_dim={rope_dim} rotates"


def _triton_rule(x, cos, sin, rope_dim, out):
    from .triton_rope import rope_supports  # imports triton: only where a kernel may run (CUDA tensors)

    return rope_supports(x, cos, sin, rope_dim)


KERNELS = (("reference", _reference_rule), ("identity", _identity_rule), ("triton_rope", _triton_rule))


def explain_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int | None = None,
    out: torch.Tensor | None = None,
) -> Choice:
    """Which kernel `rope(x, cos, sin, rope_dim)` (or, with out, `rope_into(x, cos, sin, out)`) runs and why each
    earlier one was refused. rope_dim defaults to all of x's last dim. Runs nothing."""
    rope_dim = x.shape[-1] if rope_dim is None else rope_dim
    return walk(KERNELS, x, cos, sin, rope_dim, out)
