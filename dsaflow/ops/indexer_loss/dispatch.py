"""Which kernel runs the sparse indexer loss: one table of (kernel, function, capability rule), walked by
`explain_indexer_loss` for the rows of the function called.

| kernel          | function           | runs when                                                                 |
|-----------------|--------------------|---------------------------------------------------------------------------|
| `reference`     | `attention_target` | CPU tensors, or `DSAFLOW_INDEXER_LOSS=reference` (`naive.py`)               |
| `triton_target` | `attention_target` | bf16/fp16/fp32 with q.dtype == kv.dtype, d_qk <= 1024 (fp32: <= 256)        |
| `reference`     | `indexer_kl`       | CPU tensors, `DSAFLOW_INDEXER_LOSS=reference`, or                           |
|                 |                    | `torch.use_deterministic_algorithms(True)` (train.deterministic: the        |
|                 |                    | kernel's key gradients use atomics; the reference's index_add is            |
|                 |                    | deterministic in that mode)                                                 |
| `triton_kl`     | `indexer_kl`       | bf16/fp16/fp32 with q_I.dtype == k_I.dtype, H_I <= 128, D_I <= 256          |

A CUDA call no kernel takes raises ValueError with the shapes and the reasons. `DSAFLOW_INDEXER_LOSS` (auto |
reference) is read on each call: `scripts/bench_train.py layer` compares both in one process.
"""

from __future__ import annotations

import os

import torch

from ..kernel_table import Choice, walk

ENV_CHOICE = "DSAFLOW_INDEXER_LOSS"


def reference_requested() -> bool:
    choice = os.environ.get(ENV_CHOICE, "auto")
    if choice not in ("auto", "reference"):
        raise ValueError(f"{ENV_CHOICE}={choice!r}: use auto or reference.")
    return choice == "reference"


def target_supports(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """None if the target kernel takes these inputs, else why not."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (bf16/fp16/fp32 with q.dtype == kv.dtype)"
    if q.dtype == torch.float32 and q.shape[-1] > 256:
        return f"fp32 rows of d_qk={q.shape[-1]} > 256 (the fp32 tiles do not fit in shared memory; use bf16)"
    if q.shape[-1] > 1024:
        return f"d_qk={q.shape[-1]} > 1024"
    return None


def kl_supports(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """None if the KL kernels take these inputs, else why not."""
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype:
        return f"dtypes q_I={q.dtype} k_I={k.dtype} (bf16/fp16/fp32 with q_I.dtype == k_I.dtype)"
    if q.shape[2] > 128 or q.shape[3] > 256:
        return f"H_I={q.shape[2]}, D_I={q.shape[3]} (one tile holds all heads of a query: H_I <= 128, D_I <= 256)"
    return None


def _target_reference_rule(q, kv):
    if not q.is_cuda or reference_requested():
        return None
    return f"device cuda runs the kernel ({ENV_CHOICE}=reference runs the reference)"


def _kl_reference_rule(q, k):
    if not q.is_cuda or reference_requested() or torch.are_deterministic_algorithms_enabled():
        return None
    return f"device cuda runs the kernel (deterministic algorithms or {ENV_CHOICE}=reference run the reference)"


KERNELS = (
    ("reference", "attention_target", _target_reference_rule),
    ("triton_target", "attention_target", target_supports),
    ("reference", "indexer_kl", _kl_reference_rule),
    ("triton_kl", "indexer_kl", kl_supports),
)
FUNCTIONS = ("attention_target", "indexer_kl")


def explain_indexer_loss(function: str, q: torch.Tensor, k: torch.Tensor) -> Choice:
    """Which kernel `attention_target(q, kv, ...)` (function "attention_target") or `indexer_kl(q_I, k_I, ...)`
    (function "indexer_kl") runs, and why each earlier candidate was refused. Runs nothing."""
    if function not in FUNCTIONS:
        raise ValueError(f"explain_indexer_loss: function {function!r}, expected one of {FUNCTIONS}")
    return walk([(name, rule) for name, fn, rule in KERNELS if fn == function], q, k)
