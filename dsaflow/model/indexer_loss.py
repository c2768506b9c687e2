"""Training-time indexer loss: KL distillation of attention into the lightning indexer, local to one stage.

Enabled when the stage is in training mode, has no serving cache, and `compute_indexer_loss` is on (attribute
`StageModule.compute_indexer_loss`, or the forward kwarg of the same name). During the forward:
- every layer adds, under no_grad, its attention distribution over its key set (the softmax attention probs summed
  over heads then L1-normalised, [B, T, K] aligned with the layer's indices; K = topk in sparse mode: its selected
  keys; K = S in dense mode: every causal key, column s = key s), divided by the group size, into the target buffer
  of its F layer, so no per-layer distribution outlives its layer;
- every F layer records its indexer outputs (q_I, k_I, w, indices), with gradient only to its indexer weights (the
  indexer's inputs are detached, V3.2 recipe).
Target of F layer f (IndexCache distillation) = the mean of the distributions of f and of every S layer on its stage
whose source is f. With cross-stage indices, S layers on a later stage that read f's indices are not part of it:
distillation stays stage-local (docs/planning.md, "Index sharing" says why). S layers reuse f's indices, so all the sets line up column by column.
Loss_f = KL(target || softmax(index scores on the key set)), averaged over valid queries (>= 1 visible key).

Dense mode (the dense warm-up, no cache) records no [B, T, S] tensor: each layer hands over its per-head attention
queries and keys, each F layer its indexer outputs, and `dsaflow.ops.dense_indexer_kl` streams the same loss over
key blocks (the target over all causal keys is the mean over heads and layers of the softmax probs).
The stage loss `StageModule.indexer_loss` is the SUM over the stage's F layers, so each F layer's gradient is the same
whichever way the layers are split into stages (PP=1 vs PP=N).
Sparse mode uses the `dsaflow.ops.indexer_loss` ops (fused Triton kernels on CUDA tensors, the fp32 reference on
CPU tensors, and the reference under `torch.use_deterministic_algorithms`, whose index_add is deterministic while the
kernel's key-gradient atomics are not).

Two timings for the sparse loss:
- forward (default): the targets are computed in the forward (a second Q.K^T over every layer's selected keys) and
  `loss()` returns the differentiable stage loss at once. Evaluation, and any caller that wants the value right
  after the forward, use it.
- backward (`IndexerLossInBackward`, what training runs): every layer hands `sparse_mla` its F layer's target
  buffer, and on CUDA the attention's backward fills it (dsaflow's from the probabilities it recomputes anyway,
  cuDNN-Frontend's with a Q.K^T pass after it: docs/kernels.md). Each F layer's q then passes through
  `_KLAfterAttention`, an identity whose backward runs after the attention backward of its
  whole group (the S layers come later in the forward, so their backward runs first; the F layer's own attention
  backward produces q's gradient), computes that layer's KL from the complete target, and returns its gradient
  (times the weight) to the indexer outputs within the same backward. The values are logged once every F layer of
  a microbatch has run. Under the zero-bubble schedules the node runs in the input pass and again in the weight
  pass: the KL runs once and the second call returns the same gradients. Under `train.recompute=block` a layer's
  recomputation in backward applies a copy of the node (`kl_after_attention_replay`) so that it saves the same
  tensors, and records nothing: autograd runs the first run's node, and the KL still runs once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from dsaflow.ops.dense_indexer_kl import dense_indexer_kl
from dsaflow.ops.indexer_loss import (
    attention_distribution,
    attention_target,
    gather_rows,
    index_scores_on_keys,
    indexer_kl,
    indexer_kl_loss,
)

__all__ = [
    "IndexerLossInBackward",
    "IndexerLossRecorder",
    "attention_distribution",
    "gather_rows",
    "index_scores_on_keys",
    "indexer_kl_loss",
    "kl_after_attention_replay",
]


@dataclass
class IndexerLossInBackward:
    """Asks a training stage forward for the indexer loss in its backward (see the module docstring).

    weight multiplies the KL's gradient (train.indexer_loss_weight); `values` receives, per forward, the detached
    stage loss (sum over its F layers) once that forward's backward has computed every F layer's KL."""

    weight: float = 1.0
    values: List[torch.Tensor] = field(default_factory=list)


class _KLAfterAttention(torch.autograd.Function):
    """q -> q (same storage). Backward: q's gradient passes through; the F layer's KL runs (once) and its gradient
    reaches q_I, k_I and w."""

    @staticmethod
    def forward(ctx, q, q_i, k_i, w, run):
        ctx.run, ctx.grads = run, None
        ctx.save_for_backward(q_i, k_i, w)
        return q.detach()  # an alias, like `attach_aux_loss`: no copy of q

    @staticmethod
    def backward(ctx, grad_q):
        if ctx.grads is None:  # the zero-bubble weight pass calls this node a second time
            ctx.grads = ctx.run(*ctx.saved_tensors)
        return (grad_q, *ctx.grads, None)


def _not_run(*_):
    raise RuntimeError(
        "a recomputed block's copy of the indexer-KL node ran its backward: autograd should use the first run's node"
    )


def kl_after_attention_replay(q, q_i, k_i, w) -> torch.Tensor:
    """`IndexerLossRecorder.kl_after_attention` for the recomputation of a checkpointed block: the same node, so
    the recomputation saves the same tensors in the same order as the first run, but no recorder state is touched
    (autograd runs the first run's node, whose KL runs once)."""
    return _KLAfterAttention.apply(q, q_i, k_i, w, _not_run)


class IndexerLossRecorder:
    """Collects, during one stage forward, what the indexer KL needs; `loss()` combines it.

    sources: (layer, source) for every layer of the stage (source = itself for F layers). in_backward: the sparse
    loss runs in the backward (see the module docstring), else in the forward."""

    def __init__(self, sources: Iterable[Tuple[int, int]], in_backward: Optional[IndexerLossInBackward] = None):
        self.in_backward = in_backward
        self.pending: Dict[int, Optional[torch.Tensor]] = {}  # backward mode: F layer -> its KL once computed
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
        """Sparse mode, forward timing: add this layer's attention distribution over its K keys into its F layer's
        target. rows = (t0, T): q, indices and lse are the query rows t0.. of a T-row forward (chunked attention)."""
        if layer not in self.source:  # an S layer reading another stage's indices: not distilled here
            return
        target, weight = self.target_rows(layer, indices, rows)
        with torch.autocast(q.device.type, enabled=False):
            attention_target(q.detach(), kv.detach(), indices, lse.detach(), sm_scale, target, weight)

    def target_rows(self, layer: int, indices: torch.Tensor, rows=None) -> Optional[Tuple[torch.Tensor, float]]:
        """(the rows of this layer's F-layer target [B, T, K] fp32 that this layer's distribution is added into, its
        weight 1 / group size there). indices [B, n, K]; rows = (t0, T) for a chunk of a T-row forward, else n = T.
        Backward timing hands them to `sparse_mla(..., probs_into=)`. None for a layer the recorder does not know:
        an S layer whose source sits on an earlier stage (cross-stage indices; distillation stays stage-local)."""
        if layer not in self.source:
            return None
        f = self.source[layer]
        B, n, K = indices.shape
        t0, T = rows if rows is not None else (0, n)
        if f not in self.targets:
            self.targets[f] = torch.zeros(B, T, K, device=indices.device, dtype=torch.float32)
        return self.targets[f][:, t0 : t0 + n], 1.0 / len(self.groups[f])

    def kl_after_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Backward mode, F layers: q [B, T, H, D] (the attention's query input) through `_KLAfterAttention`."""
        q_i, k_i, w, indices = self.indexer.pop(layer)
        self.pending[layer] = None

        def run(q_i, k_i, w):
            target = self.targets.pop(layer)
            with torch.enable_grad(), torch.autocast(q_i.device.type, enabled=False):
                leaves = [t.detach().requires_grad_() for t in (q_i, k_i, w)]
                loss = indexer_kl(*leaves, indices, target)
                grads = torch.autograd.grad(loss, leaves, loss.new_tensor(self.in_backward.weight))
            self._log(layer, loss.detach())
            return grads

        return _KLAfterAttention.apply(q, q_i, k_i, w, run)

    def _log(self, layer: int, loss: torch.Tensor) -> None:
        self.pending[layer] = loss
        if all(v is not None for v in self.pending.values()):
            total = None
            for f in sorted(self.pending):  # the order `loss()` sums in
                total = self.pending[f] if total is None else total + self.pending[f]
            self.in_backward.values.append(total)

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
