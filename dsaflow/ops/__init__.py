"""Ops with a stable public API. Each op folder: naive.py (fp32 reference) + Triton kernel files + dispatch."""
from .indexer_topk import indexer_topk
from .sparse_mla import sparse_mla

__all__ = ["indexer_topk", "sparse_mla"]
