"""Memory budget of the CUDA indexer's query chunks (shared with the pre-launch memory check, which must not import
triton)."""

SCORE_BUDGET_ELEMS = 1 << 28  # per chunk at most 2 GiB of int64 sort keys, or 3 GiB of fp32 scores + int64 candidates
