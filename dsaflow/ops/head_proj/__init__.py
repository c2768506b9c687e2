"""MLA's per-head latent projections (absorbed query, output up-projection) without activation copies.

Layout: `naive.py` (the einsum / cat references), the autograd.Functions whose strided batched matmuls are the
kernel (`function.py`: torch.bmm with out= views, on every device; the rope inside `absorb_query` is
`dsaflow.ops.rope`'s), the dispatch table (`dispatch.py`, `explain_head_proj`), and the public functions below.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_head_proj
from .function import AbsorbQuery, HeadOutput
from .naive import absorb_query_naive, head_output_naive


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The absorbed query [q_nope @ W_UK | rope(q_pe)], written into one buffer.

    Args:
        q: [B, T, H, N + R] per-head queries: N no-rope dims, then R rope dims.
        w_uk: [H, N, C] in q's dtype (cast outside, so autocast casts its gradient back).
        cos, sin: [B, T, R // 2] fp32.

    Returns:
        q_abs [B, T, H, C + R] in q's dtype. Differentiable in q and w_uk. The kernel is chosen by `dispatch.py`
        (`explain_head_proj("absorb_query", q, w_uk)`); inputs it refuses raise ValueError.
    """
    chosen("absorb_query", explain_head_proj("absorb_query", q, w_uk), describe(q=q, w_uk=w_uk))
    return AbsorbQuery.apply(q, w_uk, cos, sin)


def head_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The output up-projection o_lat @ W_UV^T per head, flattened over heads.

    Args:
        o_lat: [B, T, H, C] attention output in the latent space.
        w_uv: [H, V, C] in o_lat's dtype.

    Returns:
        [B, T, H * V] in o_lat's dtype. Differentiable in both; the gradient of o_lat comes back contiguous
        [B, T, H, C]. The kernel is chosen by `dispatch.py` (`explain_head_proj("head_output", o_lat, w_uv)`);
        inputs it refuses raise ValueError.
    """
    chosen("head_output", explain_head_proj("head_output", o_lat, w_uv), describe(o_lat=o_lat, w_uv=w_uv))
    return HeadOutput.apply(o_lat, w_uv)


__all__ = ["absorb_query", "explain_head_proj", "head_output", "absorb_query_naive", "head_output_naive"]
