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

Dense mode (the dense warm-up, no cache) records no [B, T, S] tensor: each layer hands over its per-head attention
queries and keys, each F layer its indexer outputs, and `dsaflow.ops.dense_indexer_kl` streams the same loss over
key blocks (the target over all causal keys is the mean over heads and layers of the softmax probs).
The stage loss `StageModule.indexer_loss` is the SUM over the stage's F layers, so each F layer's gradient is the same
whichever way the layers are split into stages (PP=1 vs PP=N).
Sparse mode uses the `dsaflow.ops.indexer_loss` ops (fused Triton kernels on CUDA tensors, the fp32 reference on
CPU tensors, and the reference under `torch.use_deterministic_algorithms`, whose index_add is deterministic while the
kernel's key-gradient atomics are not).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from dsaflow.ops.dense_indexer_kl import dense_indexer_kl
from dsaflow.ops.indexer_loss import (
    attention_distribution, attention_target, gather_rows, index_scores_on_keys, indexer_kl, indexer_kl_loss,
)

__all__ = ["IndexerLossRecorder", "attention_distribution", "gather_rows", "index_scores_on_keys", "indexer_kl_loss"]


class IndexerLossRecorder:
    """Collects, during one stage forward, what the indexer KL needs; `loss()` combines it.

    sources: (layer, source) for every layer of the stage (source = itself for F layers)."""

    def __init__(self, sources: Iterable[Tuple[int, int]]):
        self.source = dict(sources)
        self.groups: Dict[int, List[int]] = {}  # F layer -> the layers it serves (itself included), in order
        for layer, src in sorted(self.source.items()):
            self.groups.setdefault(src, []).append(layer)
        self.targets: Dict[int, torch.Tensor] = {}  # sparse: F layer -> [B, T, K] fp32 mean distribution of its group
        self.indexer: Dict[int, tuple] = {}  # sparse: F layer -> (q_I, k_I, w, indices) (grad to the indexer only)
        self.dense_attention: Dict[int, Tuple[torch.Tensor, torch.Tensor, float]] = {}  # layer -> (q, k, sm_scale)
        self.dense_index: Dict[int, Tuple[torch.Tensor, ...]] = {}  # F layer -> (q_I, k_I, w, positions)

    # Autocast off: under bf16 autocast the reference einsums would round the scores to bf16, and a KL between
    # near-uniform distributions is smaller than that rounding (it even turns negative). These are fp32 by contract.
    def record_attention(self, layer: int, q, kv, indices, lse, sm_scale: float, rows=None) -> None:
        """Sparse mode: add this layer's attention distribution over its K keys into its F layer's target.
        rows = (t0, T): q, indices and lse are the query rows t0.. of a T-row forward (chunked attention)."""
        f = self.source[layer]
        weight = 1.0 / len(self.groups[f])
        q, kv, lse = q.detach(), kv.detach(), lse.detach()
        with torch.autocast(q.device.type, enabled=False):
            if rows is None:
                self.targets[f] = attention_target(q, kv, indices, lse, sm_scale, self.targets.get(f), weight)
                return
            t0, T = rows
            B, n, K = indices.shape
            if f not in self.targets:
                self.targets[f] = torch.zeros(B, T, K, device=q.device, dtype=torch.float32)
            self.targets[f][:, t0 : t0 + n] += attention_target(q, kv, indices, lse, sm_scale, None, weight)

    def record_index_scores(self, layer: int, q, k, w, indices) -> None:
        """Sparse mode: an F layer's indexer outputs q_I [B, T, H_I, D_I], k_I [B, S, D_I], w [B, T, H_I] and the
        indices [B, T, K] its group attends to."""
        self.indexer[layer] = (q, k, w, indices)

    def record_dense_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> None:
        """Dense mode: per-head attention q [B, T, H, D], k [B, S, H, D] (scores sm_scale * q.k over causal keys).
        Kept detached: the attention's own autograd already holds these tensors, so this costs no memory."""
        self.dense_attention[layer] = (q.detach(), k.detach(), sm_scale)

    def record_dense_index(self, layer: int, q, k, w, positions) -> None:
        """Dense mode: an F layer's indexer outputs q_I [B, T, H_I, D_I], k_I [B, S, D_I], w [B, T, H_I]."""
        self.dense_index[layer] = (q, k, w, positions)

    def _dense_loss(self, f: int) -> torch.Tensor:
        """Loss_f over every causal key, streamed (never a [B, T, S] tensor)."""
        layers = self.groups[f]
        qs, ks, scales = zip(*(self.dense_attention[l] for l in layers))
        if len(set(scales)) != 1:
            raise ValueError(f"layers {layers} served by F layer {f} use different softmax scales {scales}")
        q = qs[0].unsqueeze(0) if len(qs) == 1 else torch.stack(qs)  # [L, B, T, H, D]
        k = ks[0].unsqueeze(0) if len(ks) == 1 else torch.stack(ks)
        q_i, k_i, w, positions = self.dense_index[f]
        with torch.autocast(q_i.device.type, enabled=False):
            return dense_indexer_kl(q, k, scales[0], q_i, k_i, w, positions)

    def loss(self) -> Optional[torch.Tensor]:
        """Sum over the stage's F layers of Loss_f, or None if the stage recorded no F layer."""
        total = None
        for f in sorted(self.indexer):
            target = self.targets.pop(f)
            with torch.autocast(target.device.type, enabled=False):
                loss_f = indexer_kl(*self.indexer.pop(f), target)
            total = loss_f if total is None else total + loss_f
        for f in sorted(self.dense_index):
            loss_f = self._dense_loss(f)
            total = loss_f if total is None else total + loss_f
        return total
