"""Indexer KL loss on the sparse path: attention target + KL. CUDA tensors use Triton, CPU tensors the reference.

The KL's backward adds key gradients with atomics, so under `torch.use_deterministic_algorithms(True)`
(train.deterministic) it runs the reference, whose index_add is deterministic in that mode. `DSAFLOW_INDEXER_LOSS=
reference` runs the reference on CUDA too (scripts/bench_train_layer.py compares both in one process).
"""
from __future__ import annotations

import os
import warnings

import torch

from .naive import (
    attention_distribution, attention_target_naive, gather_rows, index_scores_on_keys, indexer_kl_loss,
    indexer_kl_naive,
)


_WARNED: set = set()


def _refused(op: str, reason: str | None) -> bool:
    """True (after one loud warning per reason) when the kernels refuse a CUDA shape and the reference runs."""
    if reason is None:
        return False
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"{op}: the Triton kernels do not take {reason}; running the fp32 torch reference (slow, "
                      f"gathers [T, K, D] rows).", stacklevel=3)
    return True


def _reference_requested() -> bool:
    choice = os.environ.get("DSAFLOW_INDEXER_LOSS", "auto")
    if choice not in ("auto", "reference"):
        raise ValueError(f"DSAFLOW_INDEXER_LOSS={choice!r}: use auto or reference.")
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


@torch.no_grad()
def attention_target(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float,
    out: torch.Tensor | None = None, weight: float = 1.0,
) -> torch.Tensor:
    """Head-summed, L1-normalised attention probs of each query over its K selected keys, times `weight`.

    q [B, T, H, D_qk], kv [B, S, D_qk] (the sparse_mla inputs, same dtype), indices [B, T, K] int (-1 or >= S = no
    key), lse [B, T, H] fp32 from sparse_mla's forward -> fp32 [B, T, K]: 0 on invalid keys, an all-zero row for a
    query with no valid key. With `out` (fp32 [B, T, K]) the result is added into it in place and `out` is returned,
    so the layers an F layer serves sum into one buffer (then scale, e.g. weight = 1 / group size). No gradient.
    """
    if q.is_cuda and not _reference_requested() and not _refused("attention_target", target_supports(q, kv)):
        from .triton_target import attention_target_triton

        return attention_target_triton(q, kv, indices, lse, sm_scale, out, weight)
    return attention_target_naive(q, kv, indices, lse, sm_scale, out, weight)


def indexer_kl(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """KL(target || softmax(index scores on each query's K keys)), averaged over queries with >= 1 valid key.

    q_I [B, T, H_I, D_I], k_I [B, S, D_I] (same dtype), w [B, T, H_I], indices [B, T, K] int (-1 or >= S = no key),
    target [B, T, K] fp32 (rows sum to 1 on the valid keys) -> fp32 scalar, differentiable in q_I, k_I and w.
    scores[t, k] = sum_j w[t, j] * relu(q_I[t, j] . k_I[indices[t, k]]); the arithmetic is fp32 whatever the inputs.
    """
    if (q.is_cuda and not _reference_requested() and not torch.are_deterministic_algorithms_enabled()
            and not _refused("indexer_kl", kl_supports(q, k))):
        from .triton_kl import indexer_kl_triton

        return indexer_kl_triton(q, k, w, indices, target)
    return indexer_kl_naive(q, k, w, indices, target)


__all__ = [
    "attention_distribution", "attention_target", "attention_target_naive", "gather_rows", "index_scores_on_keys",
    "indexer_kl", "indexer_kl_loss", "indexer_kl_naive", "kl_supports", "target_supports",
]
