"""Naive fp32 reference for the lightning indexer: scores and causal top-k.

I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j,:] . k[b,s,:]), visible iff 0 <= s <= positions[b,t] and s < S.
Queries are processed in chunks so a 128K context never materialises the whole T x S score matrix.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def visible_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """positions [B, T] int -> bool [B, T, S]: key s is visible to query t iff 0 <= s <= positions[b, t]."""
    s = torch.arange(num_keys, device=positions.device)
    return s.view(1, 1, -1) <= positions.unsqueeze(-1)


def indexer_scores_naive(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Differentiable index scores in fp32, masked with -inf where a key is not visible.

    q [B, T, H, D], k [B, S, D], w [B, T, H], positions [B, T] -> scores [B, T, S] fp32.
    """
    logits = torch.einsum("bthd,bsd->bths", q.float(), k.float()).relu()
    scores = torch.einsum("bths,bth->bts", logits, w.float())
    return scores.masked_fill(~visible_mask(positions, k.shape[1]), NEG_INF)


def ascending_keys(idx: torch.Tensor) -> torch.Tensor:
    """idx int [..., K] (selected key indices, -1 = none) -> the same indices per row in ascending key order, the -1s
    last: the op's output order (deterministic, and free for the select kernels, whose candidates arrive in index
    order; the attention that consumes the indices is a sum over the set)."""
    none = torch.iinfo(idx.dtype).max
    s = torch.where(idx < 0, none, idx).sort(dim=-1).values
    return torch.where(s == none, -1, s)


def topk_from_scores(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [B, T, S] (-inf = invisible) -> int32 [B, T, topk]: the topk best keys in ascending key order, -1
    after them where fewer keys are visible (or score -inf).

    Ties are broken towards the lower key index (stable sort). `torch.topk` leaves tie order unspecified, and exact
    ties are common here (a key whose relu logits are all 0 scores exactly 0), so without a rule the same scores over a
    longer key row (a serving cache) could select a different set than over the sequence itself.
    """
    k = min(topk, scores.shape[-1])
    vals, idx = scores.sort(dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    idx = torch.where(vals == NEG_INF, torch.full_like(idx, -1), idx).to(torch.int32)
    if k < topk:  # fewer keys than topk in the whole context: pad to the static width
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return ascending_keys(idx)


@torch.no_grad()
def indexer_topk_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    chunk: int | None = None,
    fp8: bool = False,
    key_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal top-k key selection, chunked over queries.

    q [B, T, H, D], k [B, S, D], w [B, T, H], positions [B, T] (absolute position of each query; < 0 = padding)
    -> int32 [B, T, topk]: the best keys in ascending key order, -1 padding where fewer than topk keys are visible.
    chunk: queries per step; default keeps the per-head logits [B, chunk, H, S] near 2^26 elements, so a 128K
    context with 64 index heads never holds more than a few hundred MB at once.
    fp8: score the values q and k take after per-row fp8 e4m3 rounding (`fp8.quantize_rows`), as the CUDA op does.
    k may be a packed FP8 key cache uint8 [B, S, D + 4] (serve.kv_dtype=fp8): its keys are scored as stored.
    key_rows int [B, T]: query (b, t) scores the keys k[key_rows[b, t]] of a k [R, S, D] with any R (a token-major
    serving pass); each chunk gathers its queries' key rows.
    """
    if k.dtype == torch.uint8:  # a packed FP8 key cache: its keys as stored (an fp8 score keeps them, unrounded again)
        from dsaflow.ops.kv_fp8 import dequantize_fp8_rows, fp8_format_of

        fmt = fp8_format_of(k, q.shape[-1], 0)
        if fmt is None or fmt.blocks != 1:
            raise ValueError(f"indexer_topk: a uint8 k of {k.shape[-1]} bytes per key is no FP8 key cache")
        k = dequantize_fp8_rows(k, fmt)
        if fp8:
            from .fp8 import dequantize_rows, quantize_rows

            q = dequantize_rows(*quantize_rows(q))
    elif fp8:
        from .fp8 import dequantize_rows, quantize_rows

        q, k = dequantize_rows(*quantize_rows(q)), dequantize_rows(*quantize_rows(k))
    if key_rows is not None:  # every query its own batch row, scored against its gathered key row
        B, T, H, D = q.shape
        q, w, positions = q.reshape(B * T, 1, H, D), w.reshape(B * T, 1, H), positions.reshape(B * T, 1)
        rows = key_rows.reshape(B * T)
        step = chunk or max(1, min(1024, (1 << 26) // max(1, H * k.shape[1])))
        out = [
            topk_from_scores(
                indexer_scores_naive(q[a : a + step], k[rows[a : a + step]], w[a : a + step], positions[a : a + step]),
                topk,
            )
            for a in range(0, B * T, step)
        ]
        return torch.cat(out, dim=0).view(B, T, topk)
    if chunk is None:
        chunk = max(1, min(1024, (1 << 26) // max(1, q.shape[0] * q.shape[2] * k.shape[1])))
    out = []
    for t0 in range(0, q.shape[1], chunk):
        sl = slice(t0, t0 + chunk)
        out.append(topk_from_scores(indexer_scores_naive(q[:, sl], k, w[:, sl], positions[:, sl]), topk))
    return torch.cat(out, dim=1)
