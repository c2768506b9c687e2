"""Which grouped GEMM runs a MoE layer's expert matmuls: one table of (kernel, capability rule), walked in order.

| kernel          | runs when                                                                                       |
|-----------------|-------------------------------------------------------------------------------------------------|
| `torch_grouped` | CPU tensors; CUDA bf16 on sm_90+ with both matrix widths multiples of 8 (16-byte rows)           |
| `triton`        | any other CUDA call (fp32 multiplies in full fp32, fp16, bf16 off Hopper)                       |

Between the two GEMMs, the weighted SwiGLU activation runs `triton_swiglu.py` on CUDA tensors and the torch
expression on CPU tensors (`function.SwigluWeighted`).

`torch_grouped` is `torch.nn.functional.grouped_mm`: CUTLASS kernels on Hopper, a reference loop on CPU. Its CUDA
kernels take bf16 only, so fp32 runs on `triton_grouped.py` (the GPU tests' fp32 comparisons go there).
`DSAFLOW_MOE_GEMM` (auto | torch_grouped | triton; read at each call) restricts the table to one kernel, for
benchmarks and tests; a call the forced kernel refuses raises. `explain_grouped_mm(a, w)` returns the `Choice`.
"""

from __future__ import annotations

import os

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
ENV_KERNEL = "DSAFLOW_MOE_GEMM"


def explain_grouped_mm(a: torch.Tensor, w: torch.Tensor, table=KERNELS) -> Choice:
    """The kernel for a grouped GEMM of rows a [M, K] with expert weights w [E, N, K], and why earlier ones were
    refused."""
    forced = os.environ.get(ENV_KERNEL, "auto")
    names = [name for name, _ in table]
    if forced not in ("auto", *names):
        raise ValueError(f"{ENV_KERNEL}={forced!r} is not a grouped GEMM: use auto or one of {', '.join(names)}.")
    allowed = None if forced == "auto" else frozenset([forced])
    return walk(table, a, w, allowed=allowed, excluded_by=f"{ENV_KERNEL}={forced}")
