"""RMSNorm. CUDA tensors use the Triton kernels, CPU tensors the fp32 torch reference; both compute in fp32 and
return x's dtype. A CUDA input the kernels refuse raises."""

from __future__ import annotations

import torch

from .naive import rms_norm_naive


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> x / sqrt(mean(x^2) + eps) * weight, [..., D] in x.dtype (fp32 math)."""
    if x.is_cuda:
        from .triton_rmsnorm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_naive(x, weight, eps)


__all__ = ["rms_norm", "rms_norm_naive"]
