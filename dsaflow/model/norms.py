"""RMSNorm (pre-norm blocks, q/kv latent norms, final norm). The indexer's key norm is a plain nn.LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from dsaflow.ops.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back to x.dtype. x [..., dim].
    CUDA tensors run the Triton kernels, CPU tensors the torch reference (`dsaflow.ops.rmsnorm`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
