"""Serving caches of one pipeline stage, preallocated once (CUDA-graph safe), plus the stage's index slot.

Buffers (all allocated by `StageCache.allocate`, never inside forward):
- `kv[layer]`      [max_batch, max_context + 1, kv_lora_rank + qk_rope_head_dim] per DSA layer: the latent MLA row
                   (kv_norm(c_kv) | rope(k_pe)) of every cached position.
- `index_k[layer]` [max_batch, max_context + 1, index_head_dim], F layers only: the indexer key of every position.
  With serve.kv_dtype=fp8 both hold packed FP8 byte rows instead (uint8 [.., latent / key bytes], `cache_fp8.py`,
  dsaflow.config.kv_cache_format), with the same shape contract.
- `index`          [max_batch, max_tokens, topk] int32, one per stage: top-k indices written by the F layer that ran
                   last and read by the S layers it serves (max_tokens = the largest chunk of one forward).

Row `max_context` of `kv` / `index_k` is a trash row: a padding query (position < 0, or a position out of range)
writes there, so padded batches never corrupt real rows, and no query can see it (key s is visible iff
s <= position < max_context). Writes are branchless scatters at the query positions, so prefill chunks (T > 1) and
decode (T = 1) with different lengths per sequence share one code path.

Host-side bookkeeping (plain Python, no GPU sync): the `IndexSlot` records which layer wrote the indices in the
current forward, and an S layer whose planned source did not write them raises `IndexCacheError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from dsaflow.config.kv_cache_format import index_key_format, latent_format
from dsaflow.config.schema import ModelConfig

from .layer_spec import LayerSpec


class IndexCacheError(RuntimeError):
    """An S layer tried to read indices that its planned source F layer did not write in this forward."""


class IndexSlot:
    """The stage's current top-k indices: written by F layers, read by S layers.

    Without a serving cache it just holds the F layer's tensor; with one it copies into the preallocated
    `buffer [max_batch, max_tokens, topk]` and hands out the view `buffer[:B, :T]`.
    """

    def __init__(self, buffer: Optional[torch.Tensor] = None):
        self.buffer = buffer
        self.indices: Optional[torch.Tensor] = None
        self.writer: Optional[int] = None  # global index of the layer that wrote `indices` in this forward

    def begin(self) -> None:
        """Start of a stage forward: nothing has been written yet."""
        self.indices, self.writer = None, None

    def write(self, layer: int, indices: torch.Tensor) -> torch.Tensor:
        """indices [B, T, topk] int32 from F layer `layer` -> the tensor S layers will read."""
        if self.buffer is not None:
            B, T, K = indices.shape
            mb, mt, mk = self.buffer.shape
            if B > mb or T > mt or K != mk:
                raise ValueError(
                    f"index cache is [max_batch={mb}, max_tokens={mt}, topk={mk}] but layer {layer} wrote indices of "
                    f"shape [{B}, {T}, {K}]: allocate the StageCache with max_batch >= {B} and max_tokens >= {T} "
                    f"(the largest prefill chunk), or send smaller chunks."
                )
            view = self.buffer[:B, :T]
            if not (indices.data_ptr() == view.data_ptr() and indices.stride() == view.stride()):
                view.copy_(indices)  # received cross-stage indices may already sit in the buffer
            indices = view
        self.indices, self.writer = indices, layer
        return indices

    def read(self, layer: int, source: int) -> torch.Tensor:
        """Indices for S layer `layer`, whose planned source is F layer `source`; raises if `source` did not write."""
        if self.writer != source or self.indices is None:
            wrote = "no layer has written it" if self.writer is None else f"it was last written by layer {self.writer}"
            raise IndexCacheError(
                f"S layer {layer} reads the index cache of its planned source F layer {source}, but in this forward "
                f"{wrote}. An S layer may only reuse indices written by its source on the same stage during the same "
                f"forward: run the stage as a whole (a StageModule forward), not single layers, and build it from the "
                f"plan that assigned layer {layer} -> source {source}."
            )
        return self.indices


def cache_slots(positions: torch.Tensor, max_context: int) -> torch.Tensor:
    """positions [B, T] -> int64 [B, T, 1]: the cached position each query writes, positions outside
    [0, max_context) mapped to the trash row max_context. Computed once per stage forward: every layer's writes
    share it (a decode step is a few microseconds per kernel, so the per-layer masks were a visible share)."""
    inside = (positions >= 0) & (positions < max_context)
    return torch.where(inside, positions, max_context).long().unsqueeze(-1)


def write_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Scatter rows [B, T, D] into buffer [max_batch, max_context + 1, D] at `slots` [B, T, 1] (`cache_slots`).

    Returns the view buffer[:B] (all cached rows of the batch, S = max_context + 1). Branchless and allocation-free.
    """
    view = buffer[: rows.shape[0]]
    view.scatter_(1, slots.expand(-1, -1, rows.shape[-1]), rows.to(buffer.dtype))
    return view


def token_slots(slots: torch.Tensor, token_rows: torch.Tensor, max_context: int) -> torch.Tensor:
    """A token-major pass (its tokens of many cache rows side by side in one batch row): `cache_slots` [B, T, 1] and
    the cache row of each token, token_rows [B, T] -> int64 [B, T, 1], the slot in the flat view of the rows
    (`flat_rows`): row x (max_context + 1) + position, a padding token in its row's trash row."""
    return slots + token_rows.long().unsqueeze(-1) * (max_context + 1)


def flat_rows(buffer: torch.Tensor) -> torch.Tensor:
    """buffer [rows, max_context + 1, D] (contiguous rows) -> the view [1, rows x (max_context + 1), D]: every row's
    keys side by side, addressed by `token_slots` and `flat_indices`."""
    return buffer.view(1, -1, buffer.shape[-1])


def flat_indices(indices: torch.Tensor, token_rows: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Row-local top-k indices [B, T, K] (key s of the token's own row; -1 = none) -> indices into `flat_rows`
    (s + row x num_keys), -1 kept. The index slot keeps row-local indices, so S layers and cross-stage indices read
    what they would read in a [rows, T] pass."""
    offset = (token_rows.to(indices.dtype) * num_keys).unsqueeze(-1)
    return torch.where(indices >= 0, indices + offset, indices)


@dataclass
class StageCache:
    """Preallocated serving state of one stage. Build with `StageCache.allocate(...)`; see the module docstring."""

    max_batch: int
    max_context: int
    max_tokens: int
    kv: Dict[int, torch.Tensor]
    index_k: Dict[int, torch.Tensor]
    index_slot: IndexSlot = field(default_factory=IndexSlot)

    @classmethod
    def allocate(
        cls,
        model_cfg: ModelConfig,
        layers: Sequence[LayerSpec],
        max_batch: int,
        max_context: int,
        max_tokens: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_dtype: str = "bf16",
    ) -> StageCache:
        """Allocate every buffer of a span of `layers` (LayerSpec-like: index, role), kv/index_k in `dtype`, index int32
        = -1. kv_dtype="fp8" (serve.kv_dtype): kv/index_k as packed FP8 byte rows instead (`cache_fp8`)."""
        for name, value in (("max_batch", max_batch), ("max_context", max_context), ("max_tokens", max_tokens)):
            if value < 1:
                raise ValueError(f"StageCache.allocate: {name}={value} must be >= 1.")
        if kv_dtype not in ("bf16", "fp8"):
            raise ValueError(f"StageCache.allocate: kv_dtype={kv_dtype!r} (bf16 | fp8)")
        d_kv, d_key = model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim, model_cfg.index_head_dim
        if kv_dtype == "fp8":  # packed byte rows (`cache_fp8.py`): zeros decode to 0 as in a bf16 cache
            d_kv, d_key, dtype = latent_format(model_cfg).nbytes, index_key_format(model_cfg).nbytes, torch.uint8
        rows = max_context + 1  # + trash row
        kv, index_k = {}, {}
        for layer in layers:
            i = layer.index
            kv[i] = torch.zeros(max_batch, rows, d_kv, device=device, dtype=dtype)
            if layer.role == "F":
                index_k[i] = torch.zeros(max_batch, rows, d_key, device=device, dtype=dtype)
        index = torch.full((max_batch, max_tokens, model_cfg.index_topk), -1, device=device, dtype=torch.int32)
        return cls(max_batch, max_context, max_tokens, kv, index_k, IndexSlot(index))

    @property
    def index(self) -> torch.Tensor:
        """The stage's index cache [max_batch, max_tokens, topk] int32."""
        return self.index_slot.buffer

    @property
    def index_writer(self) -> Optional[int]:
        """Global index of the layer that wrote the index cache in the current forward (None before any F layer)."""
        return self.index_slot.writer

    def rows(self, start: int, stop: int) -> StageCache:
        """The cache of rows [start, stop) only: views of the same storage, and an index slot of its own over
        index[start:stop], so the rows of one serving group never read indices written for another group."""
        if not 0 <= start < stop <= self.max_batch:
            raise ValueError(f"StageCache.rows({start}, {stop}) outside the {self.max_batch} allocated rows.")
        return StageCache(
            stop - start,
            self.max_context,
            self.max_tokens,
            {i: t[start:stop] for i, t in self.kv.items()},
            {i: t[start:stop] for i, t in self.index_k.items()},
            IndexSlot(self.index_slot.buffer[start:stop]),
        )

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, length: Optional[int] = None) -> None:
        """Copy cached rows src -> dst (int64 [n] row indices of this cache, distinct dst) in every kv and index_k
        buffer: a serving group compacting its active requests. Outside any captured graph. length: copy positions
        [0, length) only (every moved row's written positions; a position beyond a row's length is written before
        any query can see it), None = the whole row."""
        stop = self.max_context + 1 if length is None else min(length, self.max_context + 1)
        for t in (*self.kv.values(), *self.index_k.values()):
            t[dst, :stop] = t[src, :stop]  # the right side is gathered first, so overlapping moves read the old rows

    def reset(self) -> None:
        """Forget every cached row (new requests). Outside any captured graph; keeps the same storage."""
        for t in (*self.kv.values(), *self.index_k.values()):
            t.zero_()
        self.index_slot.buffer.fill_(-1)
        self.index_slot.begin()
