"""Naive fp32 references for the dense indexer KL (the DeepSeek-V3.2 dense warm-up loss).

Target of one F layer over every causal key (L = the layers it serves, itself included):
  pbar[b,t,s] = 1/(L*H) * sum_{l,h} softmax_s(sm_scale * q[l,b,t,h] . k[l,b,s,h])      (s visible to t)
i.e. each layer's attention probs summed over heads and L1-normalised (each head's row sums to 1), then averaged over
the layers. Index scores I[b,t,s] = sum_j w[b,t,j] * relu(q_I[b,t,j] . k_I[b,s]). Key s is visible to query t iff
0 <= s <= positions[b,t] and s < S. Loss = mean over valid queries (position >= 0) of KL(pbar[t] || softmax(I[t])).

`dense_indexer_kl_naive` builds [B, T, S] tensors (the test reference). `dense_indexer_kl_chunked` computes the same
loss query chunk by query chunk with a recomputing backward, so its memory is O(chunk * S): the CPU path of the model.
"""

from __future__ import annotations

import torch

from dsaflow.ops.indexer_topk.naive import indexer_scores_naive, visible_mask

CHUNK_BUDGET_ELEMS = 1 << 24  # fp32 elements of the largest per-chunk intermediate ([L, B, H, chunk, S])


def dense_target_naive(q: torch.Tensor, k: torch.Tensor, sm_scale: float, positions: torch.Tensor) -> torch.Tensor:
    """q [L, B, T, H, D], k [L, B, S, H, D], positions [B, T] -> pbar fp32 [B, T, S] (rows of valid queries sum to 1,
    0 on invisible keys and on queries with no visible key). No gradient (the target is a constant)."""
    S = k.shape[2]
    vis = visible_mask(positions, S)  # [B, T, S]
    s = torch.einsum("lbthd,lbshd->lbhts", q.detach().float(), k.detach().float()) * sm_scale
    s = s.masked_fill(~vis[None, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: NaN -> 0
    return p.mean(dim=(0, 2))


def _kl_rows(target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """target [B, t, S] (0 off the visible set), scores [B, t, S] fp32 (-inf = invisible) -> KL per query [B, t]
    (0 for a query with no visible key)."""
    finite = torch.isfinite(scores)
    valid = finite.any(dim=-1, keepdim=True)
    safe = torch.where(valid, scores, torch.zeros_like(scores))  # keeps log_softmax of an empty row finite
    logp = torch.where(finite, torch.log_softmax(safe, dim=-1), torch.zeros_like(safe))
    target = target * finite
    return (torch.xlogy(target, target) - target * logp).sum(dim=-1)


def dense_indexer_kl_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    sm_scale: float,
    q_i: torch.Tensor,
    k_i: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Scalar KL(pbar || softmax(I)) averaged over queries with position >= 0; differentiable in q_i, k_i, w.

    q [L, B, T, H, D], k [L, B, S, H, D] (attention of the served layers), q_i [B, T, H_I, D_I], k_i [B, S, D_I],
    w [B, T, H_I], positions [B, T] int. Builds [B, T, S] tensors: a reference for tests, not for long contexts."""
    target = dense_target_naive(q, k, sm_scale, positions)
    kl = _kl_rows(target, indexer_scores_naive(q_i, k_i, w, positions))
    valid = (positions >= 0) & (k_i.shape[1] > 0)
    return (kl * valid).sum() / valid.sum().clamp_min(1)


def query_chunk(L: int, B: int, H: int, H_I: int, S: int, budget: int | None = None) -> int:
    """Queries per chunk so that [L, B, H, chunk, S] and [B, chunk, H_I, S] stay under `budget` elements
    (default CHUNK_BUDGET_ELEMS)."""
    budget = CHUNK_BUDGET_ELEMS if budget is None else budget
    return max(1, budget // max(1, B * S * max(L * H, H_I)))


class DenseIndexerKLChunked(torch.autograd.Function):
    """Forward: the loss chunk by chunk under no_grad. Backward: recompute each chunk with autograd and accumulate
    the gradients of q_i, k_i, w. Nothing of size [T, S] is kept between chunks."""

    @staticmethod
    def forward(ctx, q_i, k_i, w, q, k, positions, sm_scale: float, chunk: int):
        valid = (positions >= 0) & (k_i.shape[1] > 0)
        n = valid.sum().clamp_min(1).float()
        total = torch.zeros((), dtype=torch.float32, device=q_i.device)
        for t0 in range(0, q_i.shape[1], chunk):
            sl = slice(t0, t0 + chunk)
            target = dense_target_naive(q[:, :, sl], k, sm_scale, positions[:, sl])
            total += _kl_rows(target, indexer_scores_naive(q_i[:, sl], k_i, w[:, sl], positions[:, sl])).sum()
        ctx.save_for_backward(q_i, k_i, w, q, k, positions, n)
        ctx.sm_scale, ctx.chunk = sm_scale, chunk
        return total / n

    @staticmethod
    def backward(ctx, g):
        q_i, k_i, w, q, k, positions, n = ctx.saved_tensors
        dq_i, dw = torch.zeros_like(q_i, dtype=torch.float32), torch.zeros_like(w, dtype=torch.float32)
        dk_i = torch.zeros_like(k_i, dtype=torch.float32)
        for t0 in range(0, q_i.shape[1], ctx.chunk):
            sl = slice(t0, t0 + ctx.chunk)
            target = dense_target_naive(q[:, :, sl], k, ctx.sm_scale, positions[:, sl])
            with torch.enable_grad():
                qc, kc, wc = (x.detach().requires_grad_(True) for x in (q_i[:, sl], k_i, w[:, sl]))
                part = _kl_rows(target, indexer_scores_naive(qc, kc, wc, positions[:, sl])).sum() * (g / n)
                gq, gk, gw = torch.autograd.grad(part, (qc, kc, wc))
            dq_i[:, sl] += gq
            dw[:, sl] += gw
            dk_i += gk
        return dq_i.to(q_i.dtype), dk_i.to(k_i.dtype), dw.to(w.dtype), None, None, None, None, None


def dense_indexer_kl_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    sm_scale: float,
    q_i: torch.Tensor,
    k_i: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    chunk: int | None = None,
) -> torch.Tensor:
    """`dense_indexer_kl_naive`'s contract at O(chunk * S) memory (chunk default: `query_chunk`)."""
    L, B, _, H, _ = q.shape
    chunk = chunk or query_chunk(L, B, H, q_i.shape[2], k_i.shape[1])
    return DenseIndexerKLChunked.apply(q_i, k_i, w, q.detach(), k.detach(), positions, float(sm_scale), int(chunk))
