"""Which RMSNorm kernel runs a call: one table of (kernel, capability rule), walked by `explain_rms_norm`.

| kernel           | runs when                                                                                |
|------------------|------------------------------------------------------------------------------------------|
| `reference`      | CPU tensors (`naive.py`, fp32 math; autograd differentiates it)                          |
| `triton_rmsnorm` | bf16/fp16/fp32 x [..., D] and weight [D], D <= 16384 (`triton_rmsnorm.rms_norm_supports`) |

A CUDA call no kernel takes raises ValueError with the shapes and every candidate's reason.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk


def _reference_rule(x, weight):
    return f"device {x.device.type} runs the kernels" if x.is_cuda else None


def _triton_rule(x, weight):
    from .triton_rmsnorm import rms_norm_supports  # imports triton: only where a kernel may run (CUDA tensors)

    return rms_norm_supports(x, weight)


KERNELS = (("reference", _reference_rule), ("triton_rmsnorm", _triton_rule))


def explain_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> Choice:
    """Which kernel `rms_norm(x, weight, eps)` runs and why each earlier one was refused. Runs nothing."""
    return walk(KERNELS, x, weight)
