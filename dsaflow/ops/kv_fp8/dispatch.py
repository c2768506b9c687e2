"""Which FP8 cache-write kernel runs a call: one table of (kernel, capability rule), walked by `explain_write_fp8_rows`.

| kernel          | runs when                                                                               |
|-----------------|-----------------------------------------------------------------------------------------|
| `reference`     | CPU tensors (`naive.py`: quantize in torch, then a scatter)                              |
| `triton_write`  | CUDA tensors: a uint8 buffer with unit last stride and 4-byte aligned rows               |

The reads of an FP8 cache (dequantized in registers) belong to the ops that read it: `sparse_mla` and `indexer_topk`.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk


def _reference_rule(buffer, rows):
    return f"device {rows.device.type} runs the kernels" if rows.is_cuda else None


def _triton_rule(buffer, rows):
    if buffer.dtype != torch.uint8 or buffer.stride(-1) != 1 or buffer.stride(1) % 4 or buffer.stride(0) % 4:
        return f"buffer {buffer.dtype} with strides {tuple(buffer.stride())} (needs uint8, 4-byte aligned rows)"
    return None


KERNELS = (("reference", _reference_rule), ("triton_write", _triton_rule))


def explain_write_fp8_rows(buffer: torch.Tensor, rows: torch.Tensor) -> Choice:
    """Which kernel `write_fp8_rows(buffer, slots, rows, fmt)` runs and why each earlier one was refused."""
    return walk(KERNELS, buffer, rows)
