"""The int64-key top-k the radix select replaced, kept as the top-k benchmarks' baseline (no user call runs it).

fp32 logits from the op's kernel, packed into int64 keys (order-preserving score bits << 32 | 2^31 - 1 - index, so
the keys are distinct and a larger key is a better score, ties to the lower index), an unsorted torch.topk of the
keys and a sort of the survivors' indices: the same indices as `dsaflow.ops.indexer_topk.indexer_topk`, exactly.
"""

from __future__ import annotations

import torch

from dsaflow.ops.indexer_topk.budget import query_chunk
from dsaflow.ops.indexer_topk.naive import ascending_keys
from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, quantize_rows_triton

NEG_INF_KEY_HIGH = -2139095041  # order-preserving int32 of -inf (0xFF800000 ^ 0x7FFFFFFF)


def keys_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """fp32 [..., S] -> int64 [..., S] sort keys (-0.0 counts as +0.0, for the tie rule)."""
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    index = torch.arange(scores.shape[-1], device=scores.device)
    return (ordered << 32) | (2147483647 - index)


def logits_as_keys(q, k, w, positions, keys: torch.Tensor, overrides: dict | None = None, k_scale=None):
    """The indexer logits of q [B, T, H, D], k [B, S, D], w [B, T, H] written into keys int64 [B, T, S]."""
    scores = indexer_logits_triton(q, k, w, positions, overrides=overrides, k_scale=k_scale)
    return keys.copy_(keys_from_scores(scores))


def topk_from_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """keys [B, T, S] int64 -> int32 [B, T, topk]: the best keys in ascending key order, -1 after them where the
    score is -inf (exactly `naive.topk_from_scores`)."""
    S = keys.shape[-1]
    k = min(topk, S)
    vals = keys.topk(k, dim=-1, sorted=False).values
    idx = 2147483647 - (vals & 0xFFFFFFFF)
    idx = ascending_keys(torch.where((vals >> 32) > NEG_INF_KEY_HIGH, idx, -1).to(torch.int32))
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx


@torch.no_grad()
def indexer_topk_sort(q, k, w, positions, topk: int, chunk: int | None = None, fp8: bool = False) -> torch.Tensor:
    """`indexer_topk_triton`'s contract through int64 keys + torch.topk, in the same query chunks."""
    k_scale = None
    if fp8:
        q, _, w = quantize_rows_triton(q, w)
        k, k_scale = quantize_rows_triton(k)
    B, T = q.shape[:2]
    S = k.shape[1]
    out = torch.empty(B, T, topk, device=q.device, dtype=torch.int32)
    if S == 0 or T == 0:
        return out.fill_(-1)
    chunk = chunk or query_chunk(B, T, S)
    keys = torch.empty(B, min(chunk, T), S, device=q.device, dtype=torch.int64)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        buf = logits_as_keys(q[:, t0:t1], k, w[:, t0:t1], positions[:, t0:t1], keys[:, : t1 - t0], k_scale=k_scale)
        out[:, t0:t1] = topk_from_keys(buf, topk)
    return out
