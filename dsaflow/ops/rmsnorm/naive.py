"""fp32 reference for RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back to x.dtype."""

from __future__ import annotations

import torch


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x.dtype. Differentiable (autograd) in x and weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
