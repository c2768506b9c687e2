"""`DenseIndexerKLFunction`: the differentiable dense indexer KL through the Triton kernels (`triton_launch.py`)."""

from __future__ import annotations

import torch

from .triton_launch import _config, attn_lse_triton, kl_backward_triton, kl_forward_triton


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class DenseIndexerKLFunction(torch.autograd.Function):
    """Differentiable in q_i, k_i, w; q and k (the attention) and positions are constants."""

    @staticmethod
    def forward(ctx, q_i, k_i, w, q, k, positions, sm_scale: float, overrides):
        cfg = _config(q.shape[2], k.shape[2], q.shape[4], q_i.shape[3], overrides)
        lse = attn_lse_triton(q, k, positions, sm_scale, cfg)
        kl, lse_i = kl_forward_triton(q, k, lse, q_i, k_i, w, positions, sm_scale, cfg)
        valid = positions >= 0
        n = valid.sum().clamp_min(1).float()
        ctx.save_for_backward(q_i, k_i, w, q, k, positions, lse, lse_i, n)
        ctx.sm_scale, ctx.cfg = sm_scale, cfg
        return kl.sum() / n

    @staticmethod
    def backward(ctx, g):
        q_i, k_i, w, q, k, positions, lse, lse_i, n = ctx.saved_tensors
        coef = ((positions >= 0).float() * (g / n)).contiguous()
        dq_i, dk_i, dw = kl_backward_triton(q, k, lse, q_i, k_i, w, positions, lse_i, coef, ctx.sm_scale, ctx.cfg)
        return dq_i.to(q_i.dtype), dk_i.to(k_i.dtype), dw.to(w.dtype), None, None, None, None, None


def dense_indexer_kl_triton(q, k, sm_scale, q_i, k_i, w, positions, overrides: dict | None = None) -> torch.Tensor:
    """Same contract as `dsaflow.ops.dense_indexer_kl.dense_indexer_kl`; the caller checked
    `dispatch.kernel_supports`."""
    q, k, q_i, k_i = (_last_dim_contiguous(x) for x in (q.detach(), k.detach(), q_i, k_i))
    return DenseIndexerKLFunction.apply(q_i, k_i, w, q, k, positions, float(sm_scale), overrides)
