"""Which indexer top-k kernel runs a call: one table of (kernel, capability rule), walked by `explain_indexer_topk`.

| kernel         | runs when                                                                                   |
|----------------|---------------------------------------------------------------------------------------------|
| `reference`    | CPU tensors (`naive.py`: fp32 scores, fp8 by the same rounding in fp32)                      |
| `triton_radix` | any CUDA call; fp8 and a packed FP8 key cache (uint8 k) need sm_89+                         |

`triton_radix` (`triton_indexer.indexer_topk_triton`) computes the logits kernel into fp32 scores and runs the exact
radix select (`triton_select`), which reads only each row's visible prefix. fp8=True (model.index_fp8) is a
precision the caller asks for, not a kernel choice: where the GPU has no fp8 tensor cores the CUDA kernel refuses and
the call raises.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk
from .fp8 import fp8_reason


def _reference_rule(q, k, fp8):
    return f"device {q.device.type} runs the kernels" if q.is_cuda else None


def _radix_rule(q, k, fp8):
    if k.dtype == torch.uint8:  # a packed FP8 key cache
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (8, 9):
            return f"sm_{major}{minor}: serve.kv_dtype=fp8 needs fp8 loads (compute capability 8.9+); set serve.kv_dtype=bf16"
    return (fp8 and fp8_reason(q)) or None


KERNELS = (("reference", _reference_rule), ("triton_radix", _radix_rule))


def explain_indexer_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, topk: int, fp8: bool = False
) -> Choice:
    """Which kernel `indexer_topk(q, k, w, positions, topk, fp8)` runs and why each earlier one was refused. Runs
    nothing; the rules read the device and fp8 only."""
    return walk(KERNELS, q, k, fp8)
