"""Indexer KL loss on the sparse path: attention target + KL.

Layout: `naive.py` (fp32 references), the kernels (`triton_target`, `triton_kl` with its autograd.Function), the
dispatch tables (`dispatch.py`: which kernel runs, and why; CUDA shapes no kernel takes raise ValueError), and the
public functions below.
"""

from __future__ import annotations

import torch

from .dispatch import (
    chosen,
    explain_attention_target,
    explain_indexer_kl,
    kl_supports,
    reference_requested,
    target_supports,
)
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

    q [B, T, H, D_qk], kv [B, S, D_qk] (the sparse_mla inputs, same dtype), indices [B, T, K] int (-1 or >= S = no
    key), lse [B, T, H] fp32 from sparse_mla's forward -> fp32 [B, T, K]: 0 on invalid keys, an all-zero row for a
    query with no valid key. With `out` (fp32 [B, T, K]) the result is added into it in place and `out` is returned,
    so the layers an F layer serves sum into one buffer (then scale, e.g. weight = 1 / group size). No gradient.
    """
    if chosen("attention_target", explain_attention_target(q, kv), q, kv) == "triton_target":
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
    if chosen("indexer_kl", explain_indexer_kl(q, k), q, k) == "triton_kl":
        from .triton_kl import indexer_kl_triton

        return indexer_kl_triton(q, k, w, indices, target)
    return indexer_kl_naive(q, k, w, indices, target)


__all__ = [
    "attention_distribution",
    "attention_target",
    "attention_target_naive",
    "explain_attention_target",
    "explain_indexer_kl",
    "gather_rows",
    "index_scores_on_keys",
    "indexer_kl",
    "indexer_kl_loss",
    "indexer_kl_naive",
    "kl_supports",
    "reference_requested",
    "target_supports",
]
