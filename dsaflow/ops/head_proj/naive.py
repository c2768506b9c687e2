"""References for MLA's per-head latent projections (the einsum / cat formulation autograd differentiates).

H heads, N = qk_nope_head_dim, R = qk_rope_head_dim, C = kv_lora_rank, V = v_head_dim.
  absorb:  q [B, T, H, N + R], W_UK [H, N, C]  ->  q_abs = [q_nope @ W_UK | rope(q_pe)]   [B, T, H, C + R]
  output:  o_lat [B, T, H, C], W_UV [H, V, C]  ->  o_lat @ W_UV^T flattened over heads     [B, T, H * V]
"""

from __future__ import annotations

import torch

from dsaflow.ops.rope import rope_naive


def absorb_query_naive(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, N + R], w_uk [H, N, C], cos/sin [B, T, R // 2] -> q_abs [B, T, H, C + R]."""
    q_nope, q_pe = q.split([w_uk.shape[1], q.shape[-1] - w_uk.shape[1]], dim=-1)
    return torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), rope_naive(q_pe, cos, sin)], dim=-1)


def head_output_naive(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B, T, H, C], w_uv [H, V, C] -> [B, T, H * V]."""
    B, T, H, _ = o_lat.shape
    return torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * w_uv.shape[1])
