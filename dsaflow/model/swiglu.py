"""The dense SwiGLU MLP (every layer of a dense model; the shared experts of a MoE layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaflow.ops.fp8_gemm import quantize_once


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): x [..., dim] -> [..., dim] with hidden size inter_dim."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with quantize_once(x):  # FP8 weights: w1 and w3 read one quantization of x
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
