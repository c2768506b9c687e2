"""MQA-mode sparse MLA attention over selected latent rows. CUDA tensors use Triton, CPU tensors the reference."""
from __future__ import annotations

import torch

from .determinism import deterministic, is_deterministic, set_deterministic
from .naive import sparse_mla_naive


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of every head of query t over the rows kv[b, indices[b, t, :]].

    q [B, T, H, D_qk], kv [B, S, D_qk] (latent + rope; the first d_v columns are the value), indices [B, T, K] int32
    (-1 or >= S = no key), sm_scale float -> out [B, T, H, d_v] in q.dtype, lse [B, T, H] fp32 (natural log;
    -inf and out = 0 for a query with no valid key). Differentiable in q and kv. Batched: pad sequences to a common
    length and mark missing keys with -1. Small T (decode) and large T (prefill) share this entry point; B * T up to
    2^20 queries and more in one call. On CUDA, shapes the kernels refuse raise ValueError (see
    `triton_dispatch.kernel_supports`); `set_deterministic(True)` makes the backward bit-reproducible.
    """
    if q.is_cuda:
        from .triton_dispatch import sparse_mla_triton

        return sparse_mla_triton(q, kv, indices, sm_scale, d_v)
    return sparse_mla_naive(q, kv, indices, sm_scale, d_v)


__all__ = ["deterministic", "is_deterministic", "set_deterministic", "sparse_mla", "sparse_mla_naive"]
