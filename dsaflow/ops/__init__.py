"""Ops with a stable public API, one folder per op, one shape: naive.py (fp32 reference), the kernel files,
function.py (the autograd.Function, where the op has a backward), dispatch.py (one table of (kernel, capability rule)
and one `explain_<op>` function that walks it, `kernel_table.py`), and the public function in __init__.py."""

from .dense_indexer_kl import dense_indexer_kl
from .indexer_topk import indexer_topk
from .sparse_mla import sparse_mla

__all__ = ["dense_indexer_kl", "indexer_topk", "sparse_mla"]
