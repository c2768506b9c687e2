"""Training-time indexer loss: KL distillation of attention into the lightning indexer, local to one stage.

Enabled when the stage is in training mode, has no serving cache, and `compute_indexer_loss` is on (attribute
`StageModule.compute_indexer_loss`, or the forward kwarg of the same name). During the forward:
- every layer records, under no_grad, its attention distribution over its key set: the softmax attention probs summed
  over heads then L1-normalised, [B, T, K] aligned with the layer's indices (K = topk in sparse mode: its selected
  keys; K = S in dense mode: every causal key, column s = key s);
- every F layer records its index scores on the same key set, with gradient only to its indexer weights (the
  indexer's inputs are detached, V3.2 recipe).
Target of F layer f (IndexCache distillation) = the mean of the distributions of f and of every S layer whose source
is f (all on the same stage, by construction). S layers reuse f's indices, so all the sets line up column by column.
Loss_f = KL(target || softmax(index scores on the key set)), averaged over valid queries (>= 1 visible key).

Dense mode (the dense warm-up, no cache) records no [B, T, S] tensor: each layer hands over its per-head attention
queries and keys, each F layer its indexer outputs, and `dsaflow.ops.dense_indexer_kl` streams the same loss over
key blocks (the target over all causal keys is the mean over heads and layers of the softmax probs).
The stage loss `StageModule.indexer_loss` is the SUM over the stage's F layers, so each F layer's gradient is the same
whichever way the layers are split into stages (PP=1 vs PP=N).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from dsaflow.ops.dense_indexer_kl import dense_indexer_kl
from dsaflow.ops.indexer_topk import indexer_scores_naive


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, S, D], idx [B, T, K] in [0, S) -> [B, T, K, D]; backward accumulates into [B, S, D] (no [B, T, S, D]).

    index_select on the flattened rows, not advanced indexing: its backward is index_add_ (atomics on CUDA), while
    advanced indexing's is a sort-based index_put_ that took 90% of a training step on an H200."""
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


def index_scores_on_keys(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, indices: torch.Tensor, dense: bool
) -> torch.Tensor:
    """Index scores on a layer's key set, differentiable in q, k, w.

    q [B, T, H_I, D_I], k [B, S, D_I], w [B, T, H_I], indices [B, T, K] -> fp32 [B, T, K], -inf on invalid keys.
    dense=True means indices are `causal_indices` (column s = key s), so the full causal score matrix is the answer.
    """
    if dense:
        return indexer_scores_naive(q, k, w, positions)
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


class IndexerLossRecorder:
    """Collects, during one stage forward, what `indexer_kl_loss` needs; `loss(sources)` combines it."""

    def __init__(self):
        self.attention: Dict[int, torch.Tensor] = {}  # layer -> [B, T, K] distribution (no grad)
        self.scores: Dict[int, torch.Tensor] = {}  # F layer -> [B, T, K] index scores (grad to indexer only)
        self.dense_attention: Dict[int, Tuple[torch.Tensor, torch.Tensor, float]] = {}  # layer -> (q, k, sm_scale)
        self.dense_index: Dict[int, Tuple[torch.Tensor, ...]] = {}  # F layer -> (q_I, k_I, w, positions)

    # Autocast off: under bf16 autocast the einsums would round the scores to bf16, and a KL between near-uniform
    # distributions is smaller than that rounding (it even turns negative). These are fp32 by contract.
    def record_attention(self, layer: int, q, kv, indices, lse, sm_scale: float) -> None:
        with torch.autocast(q.device.type, enabled=False):
            self.attention[layer] = attention_distribution(q.detach(), kv.detach(), indices, lse.detach(), sm_scale)

    def record_index_scores(self, layer: int, q, k, w, positions, indices, dense: bool) -> None:
        with torch.autocast(q.device.type, enabled=False):
            self.scores[layer] = index_scores_on_keys(q, k, w, positions, indices, dense)

    def record_dense_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> None:
        """Dense mode: per-head attention q [B, T, H, D], k [B, S, H, D] (scores sm_scale * q.k over causal keys).
        Kept detached: the attention's own autograd already holds these tensors, so this costs no memory."""
        self.dense_attention[layer] = (q.detach(), k.detach(), sm_scale)

    def record_dense_index(self, layer: int, q, k, w, positions) -> None:
        """Dense mode: an F layer's indexer outputs q_I [B, T, H_I, D_I], k_I [B, S, D_I], w [B, T, H_I]."""
        self.dense_index[layer] = (q, k, w, positions)

    def _dense_loss(self, f: int, layers: list) -> torch.Tensor:
        """Loss_f over every causal key, streamed (never a [B, T, S] tensor)."""
        qs, ks, scales = zip(*(self.dense_attention[l] for l in layers))
        if len(set(scales)) != 1:
            raise ValueError(f"layers {layers} served by F layer {f} use different softmax scales {scales}")
        q = qs[0].unsqueeze(0) if len(qs) == 1 else torch.stack(qs)  # [L, B, T, H, D]
        k = ks[0].unsqueeze(0) if len(ks) == 1 else torch.stack(ks)
        q_i, k_i, w, positions = self.dense_index[f]
        with torch.autocast(q_i.device.type, enabled=False):
            return dense_indexer_kl(q, k, scales[0], q_i, k_i, w, positions)

    def loss(self, sources: Iterable[Tuple[int, int]]) -> Optional[torch.Tensor]:
        """sources: (layer, source) for every layer of the stage -> sum over F layers of Loss_f, or None if none."""
        groups: Dict[int, list] = {}
        for layer, source in sources:
            groups.setdefault(source, []).append(layer)
        total = None
        for f, scores in self.scores.items():
            target = torch.stack([self.attention[l] for l in groups[f]]).mean(dim=0)
            with torch.autocast(scores.device.type, enabled=False):
                loss_f = indexer_kl_loss(scores, target)
            total = loss_f if total is None else total + loss_f
        for f in self.dense_index:
            loss_f = self._dense_loss(f, groups[f])
            total = loss_f if total is None else total + loss_f
        return total
