"""Dense indexer KL (the DeepSeek-V3.2 dense warm-up loss) without [T, S] tensors.

CUDA tensors use the Triton kernels, CPU tensors the chunked reference (same loss, O(chunk * S) memory). Under
`torch.use_deterministic_algorithms(True)` (train.deterministic) CUDA runs the chunked reference too: the kernels'
key-gradient atomics would make the result depend on scheduling.
"""
from __future__ import annotations

import warnings

import torch

from .naive import dense_indexer_kl_chunked, dense_indexer_kl_naive, dense_target_naive

_warned: set = set()


def dense_indexer_kl(
    q: torch.Tensor, k: torch.Tensor, sm_scale: float, q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """KL(attention target || softmax(index scores)) over every causal key, averaged over valid queries.

    q [L, B, T, H, D], k [L, B, S, H, D]: per-head attention queries / keys of the L layers an F layer serves
    (scores sm_scale * q.k; for MLA the non-absorbed [q_nope | q_pe] and [W_UK c_kv | k_pe]). The target is each
    layer's softmax over visible keys, summed over heads, L1-normalised, averaged over the L layers.
    q_i [B, T, H_I, D_I], k_i [B, S, D_I], w [B, T, H_I]: the indexer; I[t, s] = sum_j w[t, j] relu(q_i[t, j].k_i[s]).
    positions [B, T] int: key s is visible to query t iff 0 <= s <= positions[b, t]; a query with position < 0 is
    padding and is left out of the mean. Returns a fp32 scalar, differentiable in q_i, k_i and w only (q, k are
    treated as constants). Run it outside autocast: the arithmetic is fp32 whatever the input dtypes.
    """
    if q_i.is_cuda and not torch.are_deterministic_algorithms_enabled():
        from .triton_launch import dense_indexer_kl_triton, kernel_supports

        reason = kernel_supports(q, k, q_i, k_i, w)
        if reason is None:
            return dense_indexer_kl_triton(q, k, sm_scale, q_i, k_i, w, positions)
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"dense_indexer_kl: the Triton kernels refuse {reason}; using the chunked torch reference "
                          f"(correct, much slower).", stacklevel=2)
    return dense_indexer_kl_chunked(q, k, sm_scale, q_i, k_i, w, positions)


__all__ = ["dense_indexer_kl", "dense_indexer_kl_naive", "dense_indexer_kl_chunked", "dense_target_naive"]
