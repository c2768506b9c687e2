"""`RMSNormFunction`: the differentiable RMSNorm through the Triton kernels (`triton_rmsnorm.py`)."""

from __future__ import annotations

import torch

from .triton_rmsnorm import rms_norm_bwd, rms_norm_fwd, rms_norm_supports


class RMSNormFunction(torch.autograd.Function):
    """Differentiable in x and weight; the weight gradient is deterministic (per-program partials, one sum)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(x, weight, rstd, dy)
        return dx, (dw if ctx.needs_input_grad[1] else None), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `naive.rms_norm_naive`; raises ValueError for inputs the kernels refuse."""
    reason = rms_norm_supports(x, weight)
    if reason is not None:
        raise ValueError(f"rms_norm (Triton): {reason}")
    return RMSNormFunction.apply(x, weight, float(eps))
