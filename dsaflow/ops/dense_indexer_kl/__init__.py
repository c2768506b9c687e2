"""Dense indexer KL (the DeepSeek-V3.2 dense warm-up loss) without [T, S] tensors.

Layout: `naive.py` (the fp32 reference and the chunked one, same loss in O(chunk * S) memory), the kernels
(`triton_dense_kl`, launched by `triton_launch`), the autograd.Function (`function.py`), the dispatch table
(`dispatch.py`, `explain_dense_indexer_kl`: CUDA runs the kernels, CPU and deterministic mode the chunked reference;
CUDA shapes the kernels refuse raise ValueError), and the public function below.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_dense_indexer_kl
from .naive import dense_indexer_kl_chunked, dense_indexer_kl_naive, dense_target_naive


def dense_indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    sm_scale: float,
    q_i: torch.Tensor,
    k_i: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """KL(attention target || softmax(index scores)) over every causal key, averaged over valid queries.

    The target is each layer's softmax over visible keys, summed over heads, L1-normalised, averaged over the L
    layers; the index scores are I[t, s] = sum_j w[t, j] relu(q_i[t, j] . k_i[s]).

    Args:
        q: [L, B, T, H, D] per-head attention queries of the L layers an F layer serves (for MLA the non-absorbed
            [q_nope | q_pe]); scores sm_scale * q.k.
        k: [L, B, S, H, D] their per-head keys (for MLA [W_UK c_kv | k_pe]).
        sm_scale: the attention's softmax scale.
        q_i: [B, T, H_I, D_I] index queries; k_i: [B, S, D_I] index keys; w: [B, T, H_I] per-head weights.
        positions: [B, T] int: key s is visible to query t iff 0 <= s <= positions[b, t]; a query with position < 0
            is padding and is left out of the mean.

    Returns:
        fp32 scalar, differentiable in q_i, k_i and w only (q, k are constants). Run it outside autocast: the
        arithmetic is fp32 whatever the input dtypes. The kernel is chosen by `dispatch.py`
        (`explain_dense_indexer_kl(...)`).
    """
    choice = explain_dense_indexer_kl(q, k, q_i, k_i, w)
    if chosen("dense_indexer_kl", choice, describe(q=q, k=k, q_i=q_i, k_i=k_i)) == "triton":
        from .function import dense_indexer_kl_triton

        return dense_indexer_kl_triton(q, k, sm_scale, q_i, k_i, w, positions)
    return dense_indexer_kl_chunked(q, k, sm_scale, q_i, k_i, w, positions)


__all__ = [
    "dense_indexer_kl",
    "dense_indexer_kl_chunked",
    "dense_indexer_kl_naive",
    "dense_target_naive",
    "explain_dense_indexer_kl",
]
