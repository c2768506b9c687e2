"""MQA-mode sparse MLA attention over selected latent rows.

Layout: `naive.py` (fp32 reference), the kernels (`triton_prefill`, `triton_decode`, `triton_backward`,
`triton_probs` (the indexer-loss target after cuDNN-Frontend's backward, `cudnn_backward`), and the Hopper Gluon
kernels `hopper_seesaw` + `hopper_seesaw_gather` and `hopper_backward`, sharing `hopper_common`), the
`autograd.Function` (`function.py`), the dispatch table of forward and backward kernels (`dispatch.py`), the
deterministic switch (`determinism.py`), and the public `sparse_mla` below.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .determinism import deterministic, is_deterministic, set_deterministic
from .dispatch import ENV_KERNEL, explain_sparse_mla, forced_kernels, normalised
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

    Args:
        q: [B, T, H, D_qk] queries (bf16/fp16/fp32; on CPU any float dtype).
        kv: [B, S, D_qk] latent rows (latent + rope), one per key, shared by all heads; the first d_v columns are
            the value. Same dtype as q.
        indices: [B, T, K] int, the keys each query attends to (-1 or >= S = no key).
        sm_scale: the softmax scale.
        d_v: value width.
        probs_into: (target fp32 [B, T, K], weight), for the indexer loss: adds weight * each query's attention
            probabilities summed over heads and L1-normalised over its K slots (`ops.indexer_loss.attention_target`)
            into target. Through the kernels with grad the backward adds them (dsaflow's from the probabilities it
            recomputes anyway; after cuDNN-Frontend's backward, a Q.K^T pass of dsaflow's, `triton_probs.py`), so
            target is complete only once this call's backward has run. Otherwise (CPU, or no grad) they are added
            here, by `attention_target`. Deterministic either way.

    Returns:
        (out [B, T, H, d_v] in q.dtype, lse [B, T, H] fp32, natural log): -inf and out = 0 for a query with no
        valid key. Differentiable in q and kv. Small T (decode) and large T (prefill) share this entry point; B * T
        up to 2^20 queries and more in one call (pad sequences to a common length, mark missing keys with -1).

    The kernels, forward and backward, are chosen by the table in `dispatch.py` (`explain_sparse_mla(...)` says
    which and why); a CUDA call no kernel takes raises ValueError. `set_deterministic(True)` makes the backward
    bit-reproducible.
    """
    grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    given = q, kv, indices
    q, kv, indices = normalised(q, kv, indices)
    forced = forced_kernels()[0]
    inputs = describe(q=q, kv=kv, indices=indices) + f", d_v={d_v}, grad={grad}"
    kernel = chosen("sparse_mla", explain_sparse_mla(q, kv, indices, d_v, grad), inputs + _forced(forced))
    sm_scale, d_v = float(sm_scale), int(d_v)
    if kernel == "reference":
        out, lse = sparse_mla_naive(*given, sm_scale, d_v)
    elif kernel == "empty":
        if grad and probs_into is not None:  # nothing to add: no query has a key
            return _empty_result(q, kv, indices, sm_scale, d_v)
        out, lse = _empty_result(q, kv, indices, sm_scale, d_v)
    elif grad:
        from .function import SparseMLAFunction  # the Triton backward's module: imported by CUDA calls only

        return SparseMLAFunction.apply(q, kv, indices, sm_scale, d_v, probs_into, _forward_kernel(kernel))
    else:
        out, lse = _forward_kernel(kernel, grad=False)(q, kv, indices, sm_scale, d_v)
    if probs_into is not None:
        from dsaflow.ops.indexer_loss import attention_target

        target, weight = probs_into
        with torch.autocast(q.device.type, enabled=False):
            attention_target(q.detach(), kv.detach(), indices, lse.detach(), sm_scale, target, weight)
    return out, lse


def _forward_kernel(kernel: str, grad: bool = True):
    """The forward launcher of `kernel` ("hopper_seesaw", else the Triton prefill with grad, the Triton decode
    without), imported here: the kernel modules import triton, which only a CUDA call needs."""
    if kernel == "hopper_seesaw":
        from .hopper_seesaw import sparse_mla_fwd_hopper

        return sparse_mla_fwd_hopper
    if grad:
        from .triton_prefill import sparse_mla_fwd_triton

        return sparse_mla_fwd_triton
    from .triton_decode import sparse_mla_decode_triton

    return sparse_mla_decode_triton


def _forced(setting: str) -> str:
    return f", {ENV_KERNEL}={setting}" if setting != "auto" else ""


def _empty_result(q, kv, indices, sm_scale, d_v):
    """No query, no key slot or no kv row: out = 0, lse = -inf (every query has no key), through the reference so
    that gradients (zero) still reach q and kv."""
    B, T, H = q.shape[:3]
    if B * T * H == 0:
        out = q.new_zeros(B, T, H, d_v) + q.sum() * 0 + kv.sum() * 0
        return out, torch.full((B, T, H), float("-inf"), device=q.device)
    return sparse_mla_naive(q, kv, indices[..., :0], sm_scale, d_v)


__all__ = [
    "deterministic",
    "explain_sparse_mla",
    "is_deterministic",
    "set_deterministic",
    "sparse_mla",
    "sparse_mla_naive",
]
