"""Which grouped GEMM runs a MoE layer's expert matmuls: one table of (kernel, capability rule), walked in order.

| kernel          | runs when                                                                                       |
|-----------------|-------------------------------------------------------------------------------------------------|
| `torch_grouped` | CPU tensors; CUDA bf16 on sm_90+ with both matrix widths multiples of 8 (16-byte rows)           |
| `triton`        | any other CUDA call (fp32 multiplies in full fp32, fp16, bf16 off Hopper)                       |

`torch_grouped` is `torch.nn.functional.grouped_mm`: CUTLASS kernels on Hopper, a reference loop on CPU. Its CUDA
kernels take bf16 only, so fp32 runs on `triton_grouped.py` (the GPU tests' fp32 comparisons go there).
`explain_grouped_mm(a, w)` returns the `Choice`.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk


def _torch_rule(a: torch.Tensor, w: torch.Tensor) -> str | None:
    if not a.is_cuda:
        return None
    if a.dtype != torch.bfloat16:
        return f"its CUDA kernels take bf16, not {a.dtype}"
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return "its CUDA kernels need sm_90+"
    if w.shape[1] % 8 or w.shape[2] % 8:
        return f"matrix widths {w.shape[1]} and {w.shape[2]} must be multiples of 8"
    return None


def _triton_rule(a: torch.Tensor, w: torch.Tensor) -> str | None:
    return None if a.is_cuda else f"device {a.device.type} has no Triton kernels"


KERNELS = (("torch_grouped", _torch_rule), ("triton", _triton_rule))


def explain_grouped_mm(a: torch.Tensor, w: torch.Tensor, table=KERNELS) -> Choice:
    """The kernel for a grouped GEMM of rows a [M, K] with expert weights w [E, N, K], and why earlier ones were
    refused."""
    return walk(table, a, w)
