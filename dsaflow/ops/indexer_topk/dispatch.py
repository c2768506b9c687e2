"""Which indexer top-k path runs a call: one table of (kernel, capability rule), walked in order.

| kernel         | runs when                                                                                   |
|----------------|---------------------------------------------------------------------------------------------|
| `reference`    | CPU tensors (`naive.py`: fp32 scores, fp8 by the same rounding in fp32)                      |
| `triton_radix` | S >= 8192 keys and >= 1024 score rows per query chunk (B x chunk); fp8 needs sm_89+          |
| `triton_sort`  | any other CUDA call; fp8 needs sm_89+                                                       |

Both Triton paths compute the same logits kernel and return the same indices: `triton_radix` writes fp32 scores and
runs the exact radix select (`triton_select`), `triton_sort` writes int64 sort keys for torch.topk and sorts the
survivors (`triton_indexer.topk_from_keys`); the select wins from 8K keys with enough rows to fill the GPU
(docs/kernels.md). fp8=True (model.index_fp8) is a precision the caller asks for, not a kernel choice: where the GPU
has no fp8 tensor cores every CUDA path refuses and the call raises. `explain_indexer_topk(...)` returns the `Choice`.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk
from .budget import query_chunk

RADIX_MIN_KEYS = 8192
RADIX_MIN_ROWS = 1024


def fp8_reason(q: torch.Tensor) -> str | None:
    """None if q's CUDA device has fp8 tensor cores (compute capability 8.9+), else the user-facing reason."""
    if torch.cuda.get_device_capability(q.device) >= (8, 9):
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    return (
        f"model.index_fp8=true needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper and later); "
        f"{torch.cuda.get_device_name(q.device)} is sm_{major}{minor}. Set model.index_fp8=false"
    )


def radix_reason(rows: int, S: int) -> str | None:
    """None if the radix select takes `rows` score rows (B x query chunk) of S keys, else why torch.topk runs."""
    if S < RADIX_MIN_KEYS:
        return f"S={S} < {RADIX_MIN_KEYS} keys (torch.topk on sort keys is as fast on short rows)"
    if rows < RADIX_MIN_ROWS:
        return f"{rows} rows < {RADIX_MIN_ROWS} per chunk (one program per row would leave the GPU idle)"
    return None


def choose_select(rows: int, S: int) -> str:
    """ "radix" or "sort": the Triton path for `rows` score rows of S keys (shape-only)."""
    return "radix" if radix_reason(rows, S) is None else "sort"


def _reference_rule(q, k, fp8, rows):
    return f"device {q.device.type} runs the kernels" if q.is_cuda else None


def _radix_rule(q, k, fp8, rows):
    return (fp8 and fp8_reason(q)) or radix_reason(rows, k.shape[1])


def _sort_rule(q, k, fp8, rows):
    return (fp8 and fp8_reason(q)) or None


KERNELS = (("reference", _reference_rule), ("triton_radix", _radix_rule), ("triton_sort", _sort_rule))
SELECTS = {"triton_radix": "radix", "triton_sort": "sort"}  # the `select` argument of `indexer_topk_triton`


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
