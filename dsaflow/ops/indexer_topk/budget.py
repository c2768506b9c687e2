"""Memory budget of the CUDA indexer's query chunks (shared with the pre-launch memory check, which must not import
triton)."""

SCORE_BUDGET_ELEMS = 1 << 28  # per chunk at most 2 GiB of int64 sort keys, or 3 GiB of fp32 scores + int64 candidates


def query_chunk(B: int, T: int, S: int) -> int:
    """Queries per chunk so the fp32 logits [B, chunk, S] stay under SCORE_BUDGET_ELEMS (shape-only); a multiple of
    64 (the logits kernel's query tile) when it is one at all, so long contexts reuse the same compiled kernels."""
    c = SCORE_BUDGET_ELEMS // max(1, B * S)
    return max(1, min(T, c // 64 * 64 if c >= 64 else c))
