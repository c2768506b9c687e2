"""Ops with a stable public API. Each op folder: naive.py (fp32 reference) + Triton kernel files + dispatch."""

from .dense_indexer_kl import dense_indexer_kl
from .indexer_topk import indexer_topk
from .sparse_mla import sparse_mla

__all__ = ["dense_indexer_kl", "indexer_topk", "sparse_mla"]
