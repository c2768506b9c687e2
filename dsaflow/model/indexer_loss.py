"""Training-time indexer loss: KL distillation of attention into the lightning indexer, local to one stage.

Enabled when the stage is in training mode, has no serving cache, and `compute_indexer_loss` is on (attribute
`StageModule.compute_indexer_loss`, or the forward kwarg of the same name). During the forward:
- every layer adds, under no_grad, its attention distribution over its key set (the softmax attention probs summed
  over heads then L1-normalised, [B, T, K] aligned with the layer's indices; K = topk in sparse mode: its selected
  keys; K = S in dense mode: every causal key, column s = key s), divided by the group size, into the target buffer
  of its F layer, so no per-layer distribution outlives its layer;
- every F layer records its indexer outputs (q_I, k_I, w, indices), with gradient only to its indexer weights (the
  indexer's inputs are detached, V3.2 recipe).
Target of F layer f (IndexCache distillation) = the mean of the distributions of f and of every S layer whose source
is f (all on the same stage, by construction). S layers reuse f's indices, so all the sets line up column by column.
Loss_f = KL(target || softmax(index scores on the key set)), averaged over valid queries (>= 1 visible key).
The stage loss `StageModule.indexer_loss` is the SUM over the stage's F layers, so each F layer's gradient is the same
whichever way the layers are split into stages (PP=1 vs PP=N).
Sparse mode uses the `dsaflow.ops.indexer_loss` ops (fused Triton kernels on CUDA tensors, the fp32 reference on
CPU tensors); dense mode computes both halves with the fp32 reference.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from dsaflow.ops.indexer_loss import (
    attention_distribution, attention_target, gather_rows, index_scores_on_keys, indexer_kl, indexer_kl_loss,
)
from dsaflow.ops.indexer_topk import indexer_scores_naive

__all__ = ["IndexerLossRecorder", "attention_distribution", "gather_rows", "index_scores_on_keys", "indexer_kl_loss"]


class IndexerLossRecorder:
    """Collects, during one stage forward, what the indexer KL needs; `loss()` combines it.

    sources: (layer, source) for every layer of the stage (source = itself for F layers); dense: attn == "dense"."""

    def __init__(self, sources: Iterable[Tuple[int, int]], dense: bool = False):
        self.source = dict(sources)
        self.group_size: Dict[int, int] = {}
        for src in self.source.values():
            self.group_size[src] = self.group_size.get(src, 0) + 1
        self.dense = dense
        self.targets: Dict[int, torch.Tensor] = {}  # F layer -> [B, T, K] fp32 mean distribution of its group
        self.indexer: Dict[int, tuple] = {}  # F layer -> (q_I, k_I, w, indices) (grad to the indexer only)
        self.scores: Dict[int, torch.Tensor] = {}  # dense mode: F layer -> [B, T, S] index scores

    # Autocast off: under bf16 autocast the reference einsums would round the scores to bf16, and a KL between
    # near-uniform distributions is smaller than that rounding (it even turns negative). These are fp32 by contract.
    def record_attention(self, layer: int, q, kv, indices, lse, sm_scale: float) -> None:
        f = self.source[layer]
        weight = 1.0 / self.group_size[f]
        q, kv, lse = q.detach(), kv.detach(), lse.detach()
        with torch.autocast(q.device.type, enabled=False):
            if self.dense:
                p = attention_distribution(q, kv, indices, lse, sm_scale) * weight
                self.targets[f] = p if f not in self.targets else self.targets[f].add_(p)
            else:
                self.targets[f] = attention_target(q, kv, indices, lse, sm_scale, self.targets.get(f), weight)

    def record_index_scores(self, layer: int, q, k, w, positions, indices, dense: bool) -> None:
        if dense:
            with torch.autocast(q.device.type, enabled=False):
                self.scores[layer] = indexer_scores_naive(q, k, w, positions)
        else:
            self.indexer[layer] = (q, k, w, indices)

    def loss(self) -> Optional[torch.Tensor]:
        """Sum over the stage's F layers of Loss_f, or None if the stage recorded no F layer."""
        total = None
        for f in sorted(set(self.indexer) | set(self.scores)):
            target = self.targets.pop(f)
            with torch.autocast(target.device.type, enabled=False):
                if f in self.scores:
                    loss_f = indexer_kl_loss(self.scores.pop(f), target)
                else:
                    loss_f = indexer_kl(*self.indexer.pop(f), target)
            total = loss_f if total is None else total + loss_f
        return total
