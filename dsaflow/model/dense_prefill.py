"""Short-context prefill: attention over the non-absorbed heads where sparse attention buys nothing.

When every query of a prefill chunk sees at most `index_topk` keys, the indexer would select all of them, and the
sparse kernel does dense attention at the absorbed head's cost (d_qk = C + R, d_v = C: 576 / 512 at V3.2's dims, 3.4x
the FLOPs per (query, key) pair of the non-absorbed 192 / 128). Slightly above top-k, attention over every causal key
with the top-k as a key mask still costs less than the sparse kernel, up to a crossover context.

The rule (`prefill_path`, the one place it is decided), from the pass's T (query columns) and `key_extent` = its
largest position + 1:
  sparse  T < min_tokens (decode steps included), or key_extent > max(topk, max_keys): top-k indices through
          `sparse_mla`, as before;
  dense   key_extent <= topk: exact causal attention. F layers write their indexer keys to the cache (decode reads
          them) but compute no scores and no top-k; S layers read no indices;
  masked  topk < key_extent <= max_keys: F layers run the top-k as usual (S layers read it), and attention runs over
          keys [0, key_extent) with the selected keys as a boolean mask: the same key set as the sparse path.
`plan_prefill` refines sparse for the first chunk of a long prompt (every row at positions 0, 1, .. or padding, T >
topk): its columns [0, topk) see at most topk keys, all of which the top-k would select, so they attend densely
(causal, over the non-absorbed heads) and only columns [topk, T) run sparse: the `split` hint. F layers score and
select only those columns; the first columns' indices are -1 and nobody reads them. Eager passes only: a captured
graph cannot depend on where the prompt starts.
max_keys defaults to MASKED_PREFILL_MAX_KEYS (docs/serving.md says how it was measured; `scripts/bench_indexcache.py
--part short` measures it); 0 turns the masked path off. min_tokens defaults to MIN_PREFILL_TOKENS: the non-absorbed
heads need every visible key up-projected (W_UK c, W_UV c: C (N + V) multiply-adds per key and head), which a chunk
of few queries does not amortise: in FLOPs the dense path beats the absorbed one from C (N + V) / (2 C + R - (N + R +
V) / 2) = 141 queries per chunk at V3.2's dims.

Both run per head (H heads, N nope, R rope, V value dims, C latent) from the CACHED latent rows kv [B, S, C + R], so
the keys of earlier chunks count: q = [q_nope | rope(q_pe)] (N + R), k = [W_UK c | rope(k_pe)] (N + R), v = W_UV c (V),
through `scaled_dot_product_attention` with scale (N + R)^-0.5: causal (fused kernels, no mask) when every
query at column t sits at position t, else with a boolean [T, S] mask, in query blocks that each stop at the last key
their queries can see. The sparse path is the same function in exact arithmetic (absorbed: q_nope . (W_UK c) =
(W_UK^T q_nope) . c), so the two agree to rounding.

The decision is host-side: the serving engine builds a `PrefillHint` from its host lists of positions
(`plan_prefill`) and passes it through `StageModule.forward(prefill=...)`; nothing reads the device. Captured prefill
graphs take a static hint per (path, token class) (`graph_hint`, `graph_classes`), so the graph key holds the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .rope import apply_rope

# Largest key extent (last position + 1) for which the masked path runs; 0 = off. Set from `scripts/bench_indexcache.py
# --part short` on one H200 (docs/serving.md, "Short-context prefill"): masked SDPA lost to the sparse path at every
# measured context above top-k (0.94-0.95x at 4K, 0.80-0.83x at 8K), so it is off until a masked kernel beats it.
MASKED_PREFILL_MAX_KEYS = 0
# Fewest query columns per pass for the short paths: the dense path beat the sparse one at a 2K context from the
# smallest measured chunk, 128 tokens (1.20x), on the same run (the FLOP break-even is about 141 at V3.2's dims).
MIN_PREFILL_TOKENS = 128
QUERY_BLOCK = 1024  # queries per SDPA call on the masked paths: each block stops at its own last visible key
KEY_ALIGN = 16  # key extents round up to this (aligned attention-bias rows for the memory-efficient kernel)
PATHS = ("sparse", "dense", "masked")


def prefill_path(
    tokens: int,
    key_extent: int,
    topk: int,
    max_keys: int = MASKED_PREFILL_MAX_KEYS,
    min_tokens: int = MIN_PREFILL_TOKENS,
) -> str:
    """The attention path of one serving pass: `tokens` query columns per row, every position < key_extent."""
    if tokens < max(2, min_tokens):
        return "sparse"  # decode steps keep the sparse (decode) kernels; short chunks the absorbed heads
    if key_extent <= topk:
        return "dense"
    if key_extent <= max_keys:
        return "masked"
    return "sparse"


@dataclass(frozen=True)
class PrefillHint:
    """How a prefill pass attends, decided on the host. path: "dense" | "masked" | "split". Query columns [j * block,
    (j + 1) * block) attend over cache rows [0, ends[j]), which must cover every key they can see (position + 1).
    causal: every column t of every row holds position t or padding (< 0): dense attention is then one causal SDPA
    over rows [0, T) (ends unused). split: columns [0, dense_cols) attend as the causal dense hint `prefix()` says,
    columns [dense_cols, T) sparsely over the top-k."""

    path: str
    block: int
    ends: tuple
    causal: bool = False
    dense_cols: int = 0

    def __post_init__(self):
        split_ok = self.path != "split" or (self.causal and self.dense_cols >= 1)
        if self.path not in ("dense", "masked", "split") or self.block < 1 or not self.ends or not split_ok:
            raise ValueError(
                f"PrefillHint(path={self.path!r}, block={self.block}, ends={self.ends}, causal={self.causal}, "
                f"dense_cols={self.dense_cols}) is not a hint."
            )

    def prefix(self) -> PrefillHint:
        """split: the causal dense hint of columns [0, dense_cols)."""
        return PrefillHint("dense", self.dense_cols, (self.dense_cols,), causal=True)


def _round_keys(end: int, rows: int) -> int:
    return min(max(KEY_ALIGN, -(-end // KEY_ALIGN) * KEY_ALIGN), rows)


def _aligned(row: Sequence[int]) -> bool:
    """Positions 0, 1, .., n - 1 then padding only (C-speed list operations: a chunk has up to 64K columns)."""
    try:
        n = row.index(-1)
    except ValueError:
        n = len(row)
    return list(row[:n]) == list(range(n)) and (n == len(row) or max(row[n:]) < 0)


def plan_prefill(
    positions: Sequence[Sequence[int]],
    topk: int,
    cache_rows: int,
    max_keys: int = MASKED_PREFILL_MAX_KEYS,
    min_tokens: int = MIN_PREFILL_TOKENS,
    block: int = QUERY_BLOCK,
    split: bool = True,
) -> Optional[PrefillHint]:
    """Host lists positions [rows][T] of one pass (< 0 = padding) -> its hint, or None for the sparse path.
    cache_rows: rows of the serving cache (max_context + 1). split=False: never the split hint (graph passes)."""
    T = len(positions[0]) if positions else 0
    extent = max((max(r) for r in positions), default=-1) + 1
    path = prefill_path(T, extent, topk, max_keys, min_tokens)
    if path == "sparse":
        worth = topk >= max(2, min_tokens)  # the dense columns amortise their key up-projection, as a dense pass
        if split and worth and T > topk and T < cache_rows and all(_aligned(r) for r in positions):
            return PrefillHint("split", topk, (topk,), causal=True, dense_cols=topk)
        return None
    ends = tuple(
        _round_keys(max(max(r[t0 : t0 + block]) for r in positions) + 1, cache_rows) for t0 in range(0, T, block)
    )
    causal = path == "dense" and T < cache_rows and all(_aligned(r) for r in positions)
    return PrefillHint(path, block, ends, causal)


def graph_classes(
    path: str,
    classes: Sequence[int],
    topk: int,
    max_keys: int = MASKED_PREFILL_MAX_KEYS,
    min_tokens: int = MIN_PREFILL_TOKENS,
) -> list:
    """The token classes of a prefill graph block that a pass on `path` can use: a pass of n tokens replays the
    smallest class >= n, and its key extent is at least n. A contiguous run of `classes`."""
    if path == "sparse":
        return list(classes)
    bound = topk if path == "dense" else max_keys
    out, prev = [], 0
    for c in classes:
        if c >= max(2, min_tokens) and prev + 1 <= bound and (path == "dense" or bound > topk):
            out.append(c)
        prev = c
    return out


def graph_hint(path: str, tokens: int, topk: int, cache_rows: int, max_keys: int = MASKED_PREFILL_MAX_KEYS):
    """The static hint a captured prefill graph of `tokens` columns runs on `path` (None for sparse): one query
    block over every key the path allows (topk for dense, max_keys for masked), with masks, whatever the pass."""
    if path == "sparse":
        return None
    return PrefillHint(path, tokens, (_round_keys(topk if path == "dense" else max_keys, cache_rows),), False)


def key_mask(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """indices [B, T, K] int (-1 = none) -> bool [B, T, num_keys]: key s is selected by query t."""
    B, T, _ = indices.shape
    idx = torch.where((indices >= 0) & (indices < num_keys), indices, num_keys).long()
    mask = torch.zeros(B, T, num_keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(2, idx, True)  # column num_keys collects the -1s
    return mask[..., :num_keys]


def head_tensors(mla, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, T, H, N + R] (q_pe not rotated), kv [B, S, C + R] latent rows -> per-head q [B, H, T, N + R],
    k [B, H, S, N + R], v [B, H, S, V] (views of fresh tensors; SDPA takes the strides)."""
    B, T, H, _ = q.shape
    S, N, R, V, C = kv.shape[1], mla.nope, mla.rope, mla.v_dim, mla.kv_lora_rank
    q_nope, q_pe = q.split([N, R], dim=-1)
    kvb = mla.wkv_b(kv[..., :C]).view(B, S, H, N + V)  # wkv_b.weight is [H, N + V, C]
    k_nope, v = kvb.split([N, V], dim=-1)
    # Filled by two copies each, not torch.cat: cat of strided and broadcast views takes its slow generic kernel
    # (0.5 ms per layer for the keys of 2048 tokens at V3.2's dims on an H200, several times these copies).
    qh = q.new_empty(B, T, H, N + R)
    qh[..., :N].copy_(q_nope)
    qh[..., N:].copy_(apply_rope(q_pe, cos, sin))
    kh = k_nope.new_empty(B, S, H, N + R)
    kh[..., :N].copy_(k_nope)
    kh[..., N:].copy_(kv[..., C:].unsqueeze(2))  # the rope key, shared by every head
    return qh.transpose(1, 2), kh.transpose(1, 2), v.transpose(1, 2)


def prefill_attention(
    mla,
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hint: PrefillHint,
    indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one prefill chunk over the cached rows, on the hint's path: q [B, T, H, N + R] (q_pe not
    rotated), kv [B, S_cache, C + R] (this chunk's rows already written), positions [B, T], cos / sin the MLA RoPE
    tables [B, T, R // 2], indices [B, T, topk] int32 (masked path) -> [B, T, H * V]. A padding query (position < 0)
    gets 0, like sparse_mla over no index."""
    B, T, H, _ = q.shape
    if hint.path == "masked" and indices is None:
        raise ValueError("the masked prefill path needs the top-k indices of the layer's source")
    S = T if hint.causal else max(hint.ends)
    # Rows past a row's last position were not written by its request (stale, or never written): zero them, so that
    # a masked-out key can never bring a NaN into the sum (0 * NaN), as sparse_mla never reads unselected rows.
    live = torch.arange(S, device=q.device).view(1, S) <= positions.amax(dim=1, keepdim=True)
    rows = torch.where(live.unsqueeze(-1), kv[:, :S], torch.zeros((), dtype=kv.dtype, device=kv.device))
    qh, kh, vh = head_tensors(mla, q, rows, cos, sin)
    if hint.causal:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=mla.sm_scale)
    else:
        keys = torch.arange(S, device=q.device)
        if hint.path == "dense":
            mask = keys.view(1, 1, S) <= positions.unsqueeze(-1)
        else:
            mask = key_mask(indices, S)
        # a padding query sees key 0 only (no all-masked row: SDPA would return NaN); its output is zeroed below
        mask = mask | ((keys == 0).view(1, 1, S) & (positions < 0).unsqueeze(-1))
        outs = []
        for j, end in enumerate(hint.ends):
            t0, t1 = j * hint.block, min(T, (j + 1) * hint.block)
            outs.append(
                F.scaled_dot_product_attention(
                    qh[:, :, t0:t1],
                    kh[:, :, :end],
                    vh[:, :, :end],
                    attn_mask=mask[:, None, t0:t1, :end],
                    scale=mla.sm_scale,
                )
            )
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    o = torch.where((positions >= 0).view(B, 1, T, 1), o, torch.zeros((), dtype=o.dtype, device=o.device))
    return o.transpose(1, 2).reshape(B, T, H * mla.v_dim)
