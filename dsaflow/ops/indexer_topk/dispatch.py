"""Which indexer top-k path runs a call: one table of (kernel, capability rule), walked in order.

| kernel         | runs when                                                                                   |
|----------------|---------------------------------------------------------------------------------------------|
| `reference`    | CPU tensors (`naive.py`: fp32 scores, fp8 by the same rounding in fp32)                      |
| `triton_radix` | any CUDA call; fp8 needs sm_89+                                                             |

`triton_radix` computes the logits kernel into fp32 scores and runs the exact radix select (`triton_select`), which
reads only each row's visible prefix. The other Triton path, `select="sort"` of `indexer_topk_triton` (int64 sort
keys + torch.topk, whose cost grows with the whole key axis), is kept as the benchmarks' baseline: on an H200 the
radix path was faster in 64 of 65 measured shapes (S 1K-16K keys; decode 8 and 64 rows, causal prefill, serving
passes of 64 rows x 32 and 256 tokens; indexer 8 x 64 top-256 and 64 x 128 top-2048) and within noise in the last,
and 2-6x faster on serving passes, whose cache is longer than the positions filled (docs/kernels.md). fp8=True
(model.index_fp8) is a precision the caller asks for, not a kernel choice: where the GPU has no fp8 tensor cores the
CUDA path refuses and the call raises. `explain_indexer_topk(...)` returns the `Choice`.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk
from .budget import query_chunk


def fp8_reason(q: torch.Tensor) -> str | None:
    """None if q's CUDA device has fp8 tensor cores (compute capability 8.9+), else the user-facing reason."""
    if torch.cuda.get_device_capability(q.device) >= (8, 9):
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    return (
        f"model.index_fp8=true needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper and later); "
        f"{torch.cuda.get_device_name(q.device)} is sm_{major}{minor}. Set model.index_fp8=false"
    )


def _reference_rule(q, k, fp8, rows):
    return f"device {q.device.type} runs the kernels" if q.is_cuda else None


def _radix_rule(q, k, fp8, rows):
    return (fp8 and fp8_reason(q)) or None


KERNELS = (("reference", _reference_rule), ("triton_radix", _radix_rule))
SELECTS = {"triton_radix": "radix"}  # the `select` argument of `indexer_topk_triton`


def choose_kernel(q: torch.Tensor, k: torch.Tensor, fp8: bool, chunk: int | None = None, table=KERNELS) -> Choice:
    """Walk the table for q [B, T, H_I, D_I], k [B, S, D_I] (`chunk`: queries per chunk, default `query_chunk`)."""
    B, T = q.shape[:2]
    S = k.shape[1]
    rows = B * min(chunk or query_chunk(B, T, S), T)
    return walk(table, q, k, fp8, rows)


def refusal(choice: Choice) -> str:
    """The error for a call no kernel takes: each distinct reason once."""
    return "indexer_topk: " + "; ".join(dict.fromkeys(reason for _, reason in choice.refused))


def explain_indexer_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, topk: int, fp8: bool = False
) -> Choice:
    """Which path `indexer_topk(q, k, w, positions, topk, fp8)` runs and why each earlier one was refused."""
    return choose_kernel(q, k, fp8)
