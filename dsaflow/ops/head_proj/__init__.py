"""MLA's per-head latent projections (absorbed query, output up-projection) without activation copies.

Strided batched matmuls (torch.bmm with out= views) on every device; the rope inside `absorb_query` uses the Triton
kernel on CUDA and the torch reference on CPU (`dsaflow.ops.rope`).
"""

from .functions import absorb_query, head_output
from .naive import absorb_query_naive, head_output_naive

__all__ = ["absorb_query", "head_output", "absorb_query_naive", "head_output_naive"]
