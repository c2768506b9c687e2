"""MQA-mode sparse MLA attention over selected latent rows.

Layout: `naive.py` (fp32 reference), the kernels (`triton_prefill`, `triton_decode`, `triton_backward`,
`triton_probs` (the indexer-loss target after cuDNN-Frontend's backward, `cudnn_backward`), and the
Hopper Gluon kernels `hopper_seesaw` + `hopper_seesaw_gather`, `hopper_decode`, sharing `hopper_common`), the
`autograd.Function` (`function.py`), the dispatch table (`dispatch.py`), and the public `sparse_mla` below.
"""

from __future__ import annotations

import torch

from .backward_dispatch import explain_sparse_mla_backward
from .determinism import deterministic, is_deterministic, set_deterministic
from .dispatch import explain_sparse_mla, run_sparse_mla
from .naive import sparse_mla_naive


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    probs_into: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of every head of query t over the rows kv[b, indices[b, t, :]].

    q [B, T, H, D_qk], kv [B, S, D_qk] (latent + rope; the first d_v columns are the value), indices [B, T, K] int32
    (-1 or >= S = no key), sm_scale float -> out [B, T, H, d_v] in q.dtype, lse [B, T, H] fp32 (natural log;
    -inf and out = 0 for a query with no valid key). Differentiable in q and kv. Batched: pad sequences to a common
    length and mark missing keys with -1. Small T (decode) and large T (prefill) share this entry point; B * T up to
    2^20 queries and more in one call. The kernel is chosen by the table in `dispatch.py`
    (`explain_sparse_mla(...)` says which and why); CUDA shapes no kernel takes raise ValueError. The backward is
    chosen by `backward_dispatch.py` (`explain_sparse_mla_backward(...)`).
    `set_deterministic(True)` makes the backward bit-reproducible.

    probs_into = (target fp32 [B, T, K], weight), for the indexer loss: adds weight * each query's attention
    probabilities summed over heads and L1-normalised over its K slots (`ops.indexer_loss.attention_target`) into
    target. On CUDA with grad the backward adds them: dsaflow's from the probabilities it recomputes anyway, and
    where cuDNN-Frontend's backward runs, a Q.K^T pass of dsaflow's after it (`triton_probs.py`); target is
    complete only once this call's backward has run. Otherwise (CPU, or no grad) they are added here, by
    `attention_target`. Deterministic either way.
    """
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    if probs_into is not None and q.is_cuda and needs_grad:
        return run_sparse_mla(q, kv, indices, sm_scale, d_v, probs_into)
    out, lse = run_sparse_mla(q, kv, indices, sm_scale, d_v)
    if probs_into is not None:
        from dsaflow.ops.indexer_loss import attention_target

        target, weight = probs_into
        with torch.autocast(q.device.type, enabled=False):
            attention_target(q.detach(), kv.detach(), indices, lse.detach(), sm_scale, target, weight)
    return out, lse


__all__ = [
    "deterministic",
    "explain_sparse_mla",
    "explain_sparse_mla_backward",
    "is_deterministic",
    "set_deterministic",
    "sparse_mla",
    "sparse_mla_naive",
]
