"""The dense SwiGLU MLP (every layer of a dense model; the shared experts of a MoE layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaflow.ops.fp8_gemm import Fp8Activation, shared_fp8_input


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): x [..., dim] -> [..., dim] with hidden size inter_dim."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Activation | None = None) -> torch.Tensor:
        """x [..., dim] -> [..., dim]. With FP8 weights w1 and w3 read one quantization of x: x_fp8 when the
        caller shares it with other GEMMs (a MoE layer's routed experts), else made here where a GEMM needs it."""
        if x_fp8 is None:
            x_fp8 = shared_fp8_input(x, self.w1.weight, self.w3.weight)
        gemm_input = x if x_fp8 is None else x_fp8
        return self.w2(F.silu(self.w1(gemm_input)) * self.w3(gemm_input))
