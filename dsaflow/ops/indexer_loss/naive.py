"""Naive fp32 reference for the indexer KL loss on the sparse path (DeepSeek-V3.2 indexer distillation).

Target (no grad): the head-summed, L1-normalised attention probs of a layer over each query's K selected keys,
recomputed from the sparse-MLA forward's lse. An F layer's target is the mean of the distributions of itself and of
every S layer it serves (they share its indices, so the K columns line up).
Loss: KL(target || softmax(index scores on the same K keys)), averaged over queries with at least one valid key.
Index scores: scores[t, k] = sum_j w[t, j] * relu(q_I[t, j] . k_I[indices[t, k]]); gradient to q_I, k_I, w only.
An index of -1 or >= S selects nothing: probability 0, score -inf.
"""

from __future__ import annotations

import torch


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, S, D], idx [B, T, K] in [0, S) -> [B, T, K, D]; backward accumulates into [B, S, D] (no [B, T, S, D]).

    index_select on the flattened rows, not advanced indexing: its backward is index_add_ (atomics on CUDA), while
    advanced indexing's is a sort-based index_put_ that dominated a training step on an H200."""
    B, S, D = x.shape
    flat = (idx.long() + torch.arange(B, device=x.device).view(-1, 1, 1) * S).reshape(-1)
    return x.reshape(B * S, D).index_select(0, flat).view(*idx.shape, D)


@torch.no_grad()
def attention_distribution(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float, chunk: int = 256
) -> torch.Tensor:
    """Head-summed, L1-normalised attention probs over each query's key set.

    q [B, T, H, D], kv [B, S, D], indices [B, T, K] (-1 / >= S = no key), lse [B, T, H] from sparse_mla
    -> fp32 [B, T, K] (0 on invalid keys; an all-zero row for a query with no key). Chunked over queries.
    """
    S, out = kv.shape[1], []
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse.float())
    for t0 in range(0, q.shape[1], chunk):
        idx = indices[:, t0 : t0 + chunk].long()
        valid = (idx >= 0) & (idx < S)
        rows = gather_rows(kv.float(), idx.clamp(0, S - 1))  # [B, t, K, D]
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))  # missing keys: no garbage rows
        s = torch.einsum("bthd,btkd->bthk", q[:, t0 : t0 + chunk].float(), rows) * sm_scale
        p = torch.exp(s - lse[:, t0 : t0 + chunk].unsqueeze(-1)).sum(dim=2) * valid  # [B, t, K]
        out.append(p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30))
    return torch.cat(out, dim=1)


@torch.no_grad()
def attention_target_naive(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    weight: float = 1.0,
) -> torch.Tensor:
    """`attention_distribution` * weight, added into `out` [B, T, K] fp32 when given (returned either way)."""
    p = attention_distribution(q, kv, indices, lse, sm_scale) * weight
    return p if out is None else out.add_(p)


def index_scores_on_keys(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Index scores on each query's key set, differentiable in q, k, w.

    q [B, T, H_I, D_I], k [B, S, D_I], w [B, T, H_I], indices [B, T, K] -> fp32 [B, T, K], -inf on invalid keys.
    """
    S = k.shape[1]
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    k_sel = gather_rows(k.float(), idx.clamp(0, S - 1))  # [B, T, K, D_I]
    logits = torch.einsum("bthd,btkd->bthk", q.float(), k_sel).relu()
    scores = torch.einsum("bthk,bth->btk", logits, w.float())
    return scores.masked_fill(~valid, float("-inf"))


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) per query, averaged over queries with at least one valid key.

    scores [B, T, K] fp32 (-inf = not in the key set), target [B, T, K] (rows sum to 1, 0 off the set) -> scalar.
    """
    finite = torch.isfinite(scores)
    valid_q = finite.any(dim=-1)  # [B, T]
    # A row with no valid key would make log_softmax NaN (and its gradient NaN): give it zeros, then drop it.
    safe = torch.where(valid_q.unsqueeze(-1), scores, torch.zeros_like(scores))
    logp = torch.where(finite, torch.log_softmax(safe, dim=-1), torch.zeros_like(safe))
    target = target.float() * finite
    kl = (torch.xlogy(target, target) - target * logp).sum(dim=-1)  # [B, T]
    return (kl * valid_q).sum() / valid_q.sum().clamp_min(1)


def indexer_kl_naive(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """q_I [B, T, H_I, D_I], k_I [B, S, D_I], w [B, T, H_I], indices [B, T, K], target [B, T, K] fp32 -> fp32 scalar
    KL(target || softmax(index scores on the key set)), averaged over queries with >= 1 valid key."""
    return indexer_kl_loss(index_scores_on_keys(q, k, w, indices), target)
