"""What one stage forward hands to every layer: `ForwardContext`, what every forward needs, as one of two kinds.

- `TrainContext` (no cache: training, evaluation, the dense warm-up; `StageModule.forward_train`): the keys are the
  T tokens themselves, plus the indexer-loss recorder, the recompute settings and the expert-load switch.
- `CachedContext` (serving: `StageModule.forward_prefill` / `forward_decode`): the stage's caches, the slots each
  query writes, and the prefill chunk's hint or the token-major rows.

Layers tell them apart by `ctx.cached` and read only the fields of their own kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from .cache import IndexSlot, StageCache, cache_slots, token_slots

if TYPE_CHECKING:
    from .context_parallel import ContextParallel
    from .dense_prefill import PrefillHint
    from .indexer_loss import IndexerLossRecorder

ATTN_MODES = ("sparse", "dense")


@dataclass
class ForwardContext:
    """positions [B, T] int64 absolute positions (< 0 = padding query); rope_* = (cos, sin) [B, T, rope_dim // 2].

    attn: "sparse" (top-k keys from the indexer) | "dense" (every causal key). index_slot: where F layers write and
    S layers read the stage's top-k indices. cached: whether the forward runs over serving caches (`CachedContext`)
    or over the T tokens themselves (`TrainContext`)."""

    cached: ClassVar[bool] = False
    positions: torch.Tensor
    rope_mla: tuple[torch.Tensor, torch.Tensor]
    rope_index: tuple[torch.Tensor, torch.Tensor]
    attn: str
    index_slot: IndexSlot


@dataclass
class TrainContext(ForwardContext):
    """A forward without a cache: the keys are the T tokens themselves, token t at position t.

    recorder: collects what the indexer loss needs (training only), else None.
    causal_rows: every query at row t is token t itself (positions[b, t] == t) or padding (< 0). Dense attention
    then runs as causal SDPA (FlashAttention, O(T) memory) instead of sparse_mla over `causal_indices` ([B, T, S]
    indices); StageModule sets it.
    no_padding: StageModule built the positions itself (arange: no padding query), so dense attention can skip
    zeroing padding rows.
    recompute: `train.recompute`, read only when grad is enabled. "none" keeps every activation; "attention" keeps
    each layer's attention inputs and recomputes the absorbed query, the sparse attention and the output projection
    in backward, in query chunks; "block" keeps each layer's input and recomputes the whole layer in backward (the
    attention in query chunks beyond one chunk budget).
    recompute_chunk_tokens: queries per checkpointed attention chunk when recomputing (`train.recompute_chunk_tokens`).
    replay: set by a recomputed block for its layer (see `LayerReplay`), else None.
    record_expert_load: a training forward whose MoE layers count their routed tokens (for the bias update) and
    attach their balance loss; off for evaluation and the pipelining runtime's shape inference.
    cp: context parallel (`dsaflow.model.context_parallel.ContextParallel`): the T tokens are this rank's zigzag
    shard, positions are global, and sparse attention gathers the keys of every rank; None: the whole sequence.
    """

    recorder: Optional[IndexerLossRecorder] = None
    causal_rows: bool = False
    no_padding: bool = False
    recompute: str = "none"
    recompute_chunk_tokens: int = 16384
    replay: Optional[LayerReplay] = None
    record_expert_load: bool = False
    cp: Optional[ContextParallel] = None


@dataclass
class CachedContext(ForwardContext):
    """A serving forward: each query writes its rows into `cache` at its position, then attends over the cached rows.

    slots: the cached position each query writes, [B, T, 1] int64 (`cache.cache_slots`, shared by every layer;
    filled in from positions when not given).
    prefill: the host-decided attention path of a prefill chunk short enough for attention over the non-absorbed
    heads (`dsaflow.model.dense_prefill.PrefillHint`), else None (the sparse path).
    token_rows: a token-major pass: int64 [B, T], the cache row each token writes and reads (its slots then index the
    flat view of the rows, `cache.flat_rows`); None: token (b, t) belongs to cache row b.
    """

    cached: ClassVar[bool] = True
    cache: StageCache
    slots: Optional[torch.Tensor] = None
    prefill: Optional[PrefillHint] = None
    token_rows: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.slots is None:
            self.slots = cache_slots(self.positions, self.cache.max_context)
            if self.token_rows is not None:
                self.slots = token_slots(self.slots, self.token_rows, self.cache.max_context)


RECOMPUTE_MODES = ("none", "attention", "block")


@dataclass
class LayerReplay:
    """What a recomputed block's first run chose, so that its recomputation in backward repeats the same
    computation without side effects: the indices it attended to (the index slot may hold a later microbatch's by
    then), and whether this run is the recomputation (then no recorder, slot or top-k call)."""

    indices: Optional[torch.Tensor] = None
    replaying: bool = False


def causal_indices(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """positions [B, T] -> int32 [B, T, num_keys]: column s holds key s if visible (s <= position), else -1.

    The "dense" attention mode with a serving cache (or unaligned positions): sparse_mla over every causal key
    (static shape, graph safe). O(T * S) memory: training's dense mode never builds it (see `causal_rows`)."""
    s = torch.arange(num_keys, device=positions.device, dtype=torch.int32)
    return torch.where(s.view(1, 1, -1) <= positions.unsqueeze(-1), s.view(1, 1, -1), -1).to(torch.int32)
