"""`SparseMLAFunction`: the differentiable sparse MLA on CUDA (a prefill forward kernel + the backward that
`backward_dispatch.py` picks: dsaflow's Triton one, or cuDNN-Frontend's where installed and its rule holds)."""

from __future__ import annotations

import torch

from .backward_dispatch import check_forced_backward, sparse_mla_backward
from .hopper_seesaw import sparse_mla_fwd_hopper
from .triton_prefill import key_extent, sparse_mla_fwd_triton

FORWARDS = {"hopper_seesaw": sparse_mla_fwd_hopper, "triton_prefill": sparse_mla_fwd_triton}


class SparseMLAFunction(torch.autograd.Function):
    """Differentiable in q and kv (and through lse); indices are integer inputs without gradient. `forward_kernel`
    names the forward ("hopper_seesaw" or "triton_prefill", chosen by `dispatch.py`); the backward is chosen at
    backward time by `backward_dispatch.py`, deterministic when `determinism.is_deterministic()` holds then.
    probs_into = (target, weight) is filled by the backward (`sparse_mla`'s docstring). Gradients are not
    materialised: d_lse is None when lse receives none (cuDNN-Frontend's backward takes no lse gradient)."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale: float, d_v: int, probs_into, forward_kernel: str):
        check_forced_backward()
        ctx.set_materialize_grads(False)
        # each query's key extent (1 + its last valid slot), computed once for the forward and the backward
        n_keys = key_extent(indices, kv.shape[1])
        out, lse = FORWARDS[forward_kernel](q, kv, indices, sm_scale, d_v, n_keys=n_keys)
        ctx.save_for_backward(q, kv, indices, out, lse, n_keys)
        # an output buffer the backward adds into (not saved: autograd must not version-check it)
        ctx.sm_scale, ctx.d_v, ctx.probs_into = sm_scale, d_v, probs_into
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, indices, out, lse, n_keys = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dkv = sparse_mla_backward(
            q, kv, indices, out, lse, d_out, d_lse, ctx.sm_scale, ctx.d_v, n_keys, ctx.probs_into
        )
        return dq, dkv, None, None, None, None, None
