"""Dense indexer KL (the DeepSeek-V3.2 dense warm-up loss) without [T, S] tensors.

Layout: `naive.py` (the fp32 reference and the chunked one, same loss in O(chunk * S) memory), the kernels
(`triton_kl`, launched with their autograd.Function by `triton_launch`), the dispatch table (`dispatch.py`: CUDA
runs the kernels, CPU and deterministic mode the chunked reference; CUDA shapes the kernels refuse raise
ValueError), and the public function below.
"""

from __future__ import annotations

import torch

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

    q [L, B, T, H, D], k [L, B, S, H, D]: per-head attention queries / keys of the L layers an F layer serves
    (scores sm_scale * q.k; for MLA the non-absorbed [q_nope | q_pe] and [W_UK c_kv | k_pe]). The target is each
    layer's softmax over visible keys, summed over heads, L1-normalised, averaged over the L layers.
    q_i [B, T, H_I, D_I], k_i [B, S, D_I], w [B, T, H_I]: the indexer; I[t, s] = sum_j w[t, j] relu(q_i[t, j].k_i[s]).
    positions [B, T] int: key s is visible to query t iff 0 <= s <= positions[b, t]; a query with position < 0 is
    padding and is left out of the mean. Returns a fp32 scalar, differentiable in q_i, k_i and w only (q, k are
    treated as constants). Run it outside autocast: the arithmetic is fp32 whatever the input dtypes.
    """
    choice = explain_dense_indexer_kl(q, k, q_i, k_i, w)
    if choice.kernel == "triton":
        from .triton_launch import dense_indexer_kl_triton

        return dense_indexer_kl_triton(q, k, sm_scale, q_i, k_i, w, positions)
    if choice.kernel is None:
        raise ValueError(
            f"dense_indexer_kl: no kernel takes q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, q_i "
            f"{tuple(q_i.shape)} {q_i.dtype}, k_i {tuple(k_i.shape)}: {choice.reasons()}"
        )
    return dense_indexer_kl_chunked(q, k, sm_scale, q_i, k_i, w, positions)


__all__ = [
    "dense_indexer_kl",
    "dense_indexer_kl_chunked",
    "dense_indexer_kl_naive",
    "dense_target_naive",
    "explain_dense_indexer_kl",
]
