"""Indexer KL loss on the sparse path: attention target + KL.

Layout: `naive.py` (fp32 references), the kernels (`triton_target`, `triton_kl`), the autograd.Function of the KL
(`function.py`), the dispatch table (`dispatch.py`, `explain_indexer_loss`: which kernel runs, and why; CUDA shapes
no kernel takes raise ValueError), and the public functions below.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_indexer_loss, kl_supports, reference_requested, target_supports
from .naive import (
    attention_distribution,
    attention_target_naive,
    gather_rows,
    index_scores_on_keys,
    indexer_kl_loss,
    indexer_kl_naive,
)


@torch.no_grad()
def attention_target(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    weight: float = 1.0,
) -> torch.Tensor:
    """Head-summed, L1-normalised attention probs of each query over its K selected keys, times `weight`.

    Args:
        q: [B, T, H, D_qk] and kv [B, S, D_qk]: the sparse_mla inputs, same dtype.
        indices: [B, T, K] int (-1 or >= S = no key).
        lse: [B, T, H] fp32 from sparse_mla's forward.
        sm_scale: sparse_mla's softmax scale.
        out: optional fp32 [B, T, K]; the result is added into it in place, so the layers an F layer serves sum
            into one buffer.
        weight: scales what is added (e.g. 1 / group size).

    Returns:
        fp32 [B, T, K] (`out` when given): 0 on invalid keys, an all-zero row for a query with no valid key. No
        gradient. The kernel is chosen by `dispatch.py` (`explain_indexer_loss("attention_target", q, kv)`).
    """
    kernel = chosen("attention_target", explain_indexer_loss("attention_target", q, kv), describe(q=q, kv=kv))
    if kernel == "triton_target":
        from .triton_target import attention_target_triton

        return attention_target_triton(q, kv, indices, lse, sm_scale, out, weight)
    return attention_target_naive(q, kv, indices, lse, sm_scale, out, weight)


def indexer_kl(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """KL(target || softmax(index scores on each query's K keys)), averaged over queries with >= 1 valid key.

    scores[t, k] = sum_j w[t, j] * relu(q_I[t, j] . k_I[indices[t, k]]); the arithmetic is fp32 whatever the inputs.

    Args:
        q: [B, T, H_I, D_I] index queries q_I; k: [B, S, D_I] index keys k_I, same dtype.
        w: [B, T, H_I] per-head weights.
        indices: [B, T, K] int (-1 or >= S = no key).
        target: [B, T, K] fp32, rows summing to 1 on the valid keys (`attention_target`).

    Returns:
        fp32 scalar, differentiable in q_I, k_I and w. The kernel is chosen by `dispatch.py`
        (`explain_indexer_loss("indexer_kl", q, k)`).
    """
    if chosen("indexer_kl", explain_indexer_loss("indexer_kl", q, k), describe(q_I=q, k_I=k)) == "triton_kl":
        from .function import indexer_kl_triton

        return indexer_kl_triton(q, k, w, indices, target)
    return indexer_kl_naive(q, k, w, indices, target)


__all__ = [
    "attention_distribution",
    "attention_target",
    "attention_target_naive",
    "explain_indexer_loss",
    "gather_rows",
    "index_scores_on_keys",
    "indexer_kl",
    "indexer_kl_loss",
    "indexer_kl_naive",
    "kl_supports",
    "reference_requested",
    "target_supports",
]
