"""Lightning indexer + causal top-k.

Layout: `naive.py` (fp32 reference), the kernels (`triton_indexer`: the logits and the op's launcher,
`triton_select` + `radix_bits`: the radix select, `fp8.py`: the fp8 rows), `dispatch.py` (the table and
`explain_indexer_topk`), and the public `indexer_topk` below. No gradient flows through the indices, so there is no
autograd.Function.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_indexer_topk
from .naive import ascending_keys, indexer_scores_naive, indexer_topk_naive, topk_from_scores, visible_mask


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    fp8: bool = False,
    key_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k keys per query by index score I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s]), causal by position.

    Args:
        q: [B, T, H_I, D_I] index queries (any float dtype; accumulation is fp32).
        k: [B, S, D_I] index keys, or a packed FP8 key cache uint8 [B, S, D_I + 4] (serve.kv_dtype=fp8: e4m3 keys
            and one fp32 scale each, dsaflow.ops.kv_fp8), read in place and dequantized in registers.
        w: [B, T, H_I] per-head weights.
        positions: [B, T] int, the absolute position of each query; key s is visible iff s <= position (< 0 =
            padding, nothing visible).
        topk: keys to select per query.
        fp8: score with q and k rounded to per-row-scaled fp8 e4m3 (`fp8.quantize_rows`, DeepSeek-V3.2's indexer
            precision): on CUDA through fp8 tensor cores (compute capability 8.9+, else ValueError), on CPU through
            the same rounding in fp32.
        key_rows: None (query (b, t) scores k[b]), or int [B, T]: the row of k [R, S, D_I] (any R) that query (b, t)
            scores: a token-major serving pass, whose tokens of many cache rows sit side by side in one batch row.

    Returns:
        int32 [B, T, topk]: the topk best keys (ties to the lower key index) in ascending key order, -1 after them
        where fewer than topk keys are visible. Graph-safe on CUDA. The kernel is chosen by `dispatch.py`
        (`explain_indexer_topk(...)` says which and why).
    """
    choice = explain_indexer_topk(q, k, w, positions, topk, fp8)
    if chosen("indexer_topk", choice, describe(q=q, k=k)) == "reference":
        return indexer_topk_naive(q, k, w, positions, topk, fp8=fp8, key_rows=key_rows)
    from .triton_indexer import indexer_topk_triton

    return indexer_topk_triton(q, k, w, positions, topk, fp8=fp8, key_rows=key_rows)


__all__ = [
    "ascending_keys",
    "explain_indexer_topk",
    "indexer_topk",
    "indexer_topk_naive",
    "indexer_scores_naive",
    "topk_from_scores",
    "visible_mask",
]
