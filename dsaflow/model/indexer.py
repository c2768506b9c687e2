"""Lightning indexer (DeepSeek-V3.2): picks the top-k keys each query attends to. F layers only.

q_I = wq_b(q_latent)                      [B, T, index_n_heads, index_head_dim]   (q_latent = MLA's q_norm(wq_a(x)))
k_I = k_norm(wk(x))                       [B, S, index_head_dim]                  (one key per token, all heads)
w   = weights_proj(x) * n_I^-0.5 * d_I^-0.5   [B, T, index_n_heads]
RoPE (half-split) on the first index_rope_head_dim dims of q_I and k_I.
I[t, s] = sum_j w[t, j] * relu(q_I[t, j] . k_I[s]); the op `indexer_topk` keeps the top `index_topk` causal keys.

The indexer's inputs are detached from the main path (V3.2 recipe): its weights learn only from the indexer KL loss
(dsaflow.model.indexer_loss), and the LM loss never reaches them (top-k indices carry no gradient anyway).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaflow.config.schema import ModelConfig
from dsaflow.ops.fp8_gemm import Fp8Activation

from .rope import apply_rope_prefix


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.index_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=cfg.index_norm_eps)
        self.weights_proj = nn.Linear(cfg.dim, cfg.index_n_heads, bias=False)
        self.weight_scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        x_fp8: Fp8Activation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim], q_latent [B, T, q_lora] (both detached here), rope (cos, sin) [B, T, rope_dim // 2]
        -> q_I [B, T, n_I, d_I], k_I [B, T, d_I], w [B, T, n_I]. x_fp8: x's FP8 quantization, shared with MLA's
        projections, for an FP8 wk (`keys`)."""
        x, q_latent = x.detach(), q_latent.detach()
        B, T, _ = x.shape
        cos, sin = rope
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        q = apply_rope_prefix(q, cos, sin, self.rope_dim)
        # LayerNorm runs in fp32 under autocast; keep q and k in one dtype for the kernels.
        k = self.keys(x, rope, x_fp8).to(q.dtype)
        w = self.weights_proj(x) * self.weight_scale
        return q, k, w

    def keys(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], x_fp8: Fp8Activation | None = None
    ) -> torch.Tensor:
        """x [B, T, dim] -> k_I [B, T, d_I] alone: what a serving cache keeps for decode when a short prefill
        chunk needs no top-k (dsaflow.model.dense_prefill). x_fp8: x quantized for an FP8 wk (no gradient)."""
        cos, sin = rope
        k = self.wk(x.detach() if x_fp8 is None else x_fp8)
        return apply_rope_prefix(self.k_norm(k), cos, sin, self.rope_dim)
