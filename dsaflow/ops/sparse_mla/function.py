"""`SparseMLAFunction`: the differentiable sparse MLA through the kernels (a forward kernel that `dispatch.py` chose,
and at backward time the backward its table picks: dsaflow's, or cuDNN-Frontend's where installed and its rule
holds)."""

from __future__ import annotations

import logging

import torch

from dsaflow.errors import PlanError

from . import cudnn_backward as cb
from .determinism import is_deterministic
from .dispatch import ENV_BACKWARD, TARGET_PASS_AFTER, check_forced_backward, explain_sparse_mla, forced_backward
from .triton_backward import sparse_mla_bwd_triton
from .triton_prefill import key_extent
from .triton_probs import sparse_mla_probs_triton

log = logging.getLogger("dsaflow.ops.sparse_mla")
_LOGGED: set[str] = set()


def backward_label(kernel: str, probs_into: bool) -> str:
    """What runs for the target too: "cudnn + target pass (triton_probs)" where one of `TARGET_PASS_AFTER` runs
    with `probs_into`, else the backward's name."""
    return f"{kernel} + target pass (triton_probs)" if probs_into and kernel in TARGET_PASS_AFTER else kernel


def backward_kernel(q, kv, indices, d_v: int, lse_grad: bool, probs_into: bool, deterministic: bool) -> str:
    """The backward the table picks for this call, logged at INFO the first time each backward (`backward_label`)
    runs in this process. Raises PlanError when none takes it (only possible when forced)."""
    choice = explain_sparse_mla(
        q, kv, indices, d_v, backward=True, lse_grad=lse_grad, probs_into=probs_into, deterministic=deterministic
    )
    setting = forced_backward()[0]
    if choice.kernel is None:
        raise PlanError(
            f"{ENV_BACKWARD}={setting}, but that backward does not take q {tuple(q.shape)} {q.dtype}, kv "
            f"{tuple(kv.shape)}, d_v={d_v}, lse_grad={lse_grad}, probs_into={probs_into}, "
            f"deterministic={deterministic}: {choice.reasons()}. Set {ENV_BACKWARD}=auto to let the dispatch rule "
            "pick per call."
        )
    label = backward_label(choice.kernel, probs_into)
    if label not in _LOGGED:
        _LOGGED.add(label)
        version = cb.cudnn_version() if choice.kernel == "cudnn" else None
        version = f" {version}" if version else ""
        log.info("sparse_mla backward: %s%s (%s=%s; %s)", label, version, ENV_BACKWARD, setting, choice)
    return choice.kernel


class SparseMLAFunction(torch.autograd.Function):
    """Differentiable in q and kv (and through lse); indices are integer inputs without gradient. `forward` is the
    forward kernel's launcher (`sparse_mla_fwd_hopper` or `sparse_mla_fwd_triton`, as `dispatch.py` chose); the
    backward is chosen at backward time, deterministic when `determinism.is_deterministic()` holds then.
    probs_into = (target, weight) is filled by the backward (`sparse_mla`'s docstring). Gradients are not
    materialised: d_lse is None when lse receives none (cuDNN-Frontend's backward takes no lse gradient)."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale: float, d_v: int, probs_into, forward):
        check_forced_backward()
        ctx.set_materialize_grads(False)
        # each query's key extent (1 + its last valid slot), computed once for the forward and the backward
        n_keys = key_extent(indices, kv.shape[1])
        out, lse = forward(q, kv, indices, sm_scale, d_v, n_keys=n_keys)
        ctx.save_for_backward(q, kv, indices, out, lse, n_keys)
        # an output buffer the backward adds into (not saved: autograd must not version-check it)
        ctx.sm_scale, ctx.d_v, ctx.probs_into = sm_scale, d_v, probs_into
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, indices, out, lse, n_keys = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        sm_scale, d_v, probs_into, det = ctx.sm_scale, ctx.d_v, ctx.probs_into, is_deterministic()
        kernel = backward_kernel(q, kv, indices, d_v, d_lse is not None, probs_into is not None, det)
        if kernel == "cudnn":
            dq, dkv = cb.sparse_mla_bwd_cudnn(q, kv, indices, out, lse, d_out, sm_scale, d_v, n_keys, det)
        else:  # dsaflow's backward adds the target from the P of its pass 1
            args = q, kv, indices, out, lse, d_out, d_lse, sm_scale, d_v
            dq, dkv = sparse_mla_bwd_triton(
                *args, deterministic=det, n_keys=n_keys, probs_into=probs_into, pass1=kernel
            )
        if probs_into is not None and kernel in TARGET_PASS_AFTER:
            sparse_mla_probs_triton(q, kv, indices, lse, sm_scale, d_v, probs_into, n_keys=n_keys)
        return dq, dkv, None, None, None, None, None
