"""Multi-head latent attention (DeepSeek-V3 MLA), always computed in MQA (absorbed) mode through `sparse_mla`.

Shapes (H = n_heads, C = kv_lora_rank, R = qk_rope_head_dim, N = qk_nope_head_dim, V = v_head_dim):
  q_latent = q_norm(wq_a(x))                          [B, T, q_lora]
  q        = wq_b(q_latent) -> [q_nope | q_pe]        [B, T, H, N + R], RoPE on q_pe
  kv row   = [kv_norm(c_kv) | rope(k_pe)]             [B, S, C + R]   (wkv_a(x) = [c_kv | k_pe]; shared by all heads)
  wkv_b.weight viewed as [H, N + V, C]: W_UK = [:, :N], W_UV = [:, N:]
  q_abs    = [q_nope @ W_UK | q_pe]                   [B, T, H, C + R]   (d_qk = C + R)
  o_lat    = sparse_mla(q_abs, kv, indices, sm_scale=(N + R)^-0.5, d_v=C)  [B, T, H, C]
  out      = wo(o_lat @ W_UV^T)                       [B, T, dim]
The absorbed form is exactly the naive MLA (q_nope . (W_UK c) = (W_UK^T q_nope) . c), and it is the same computation
in training, prefill and decode. The indices come from the layer's own indexer (F), from the stage's index slot
written by its source (S), or are every causal key (attn="dense").

Dense attention without a cache (training, the dense warm-up) runs the non-absorbed form instead, per head
  q = [q_nope | rope(q_pe)] (N + R),  k = [W_UK c | rope(k_pe)] (N + R),  v = W_UV c (V),
through causal `scaled_dot_product_attention` (FlashAttention on GPU): no [B, T, S] index tensor, O(T) memory.
Its indexer loss uses the same per-head q and k (dsaflow.ops.dense_indexer_kl, streamed over key blocks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsaflow.config.schema import ModelConfig
from dsaflow.ops import indexer_topk, sparse_mla
from dsaflow.ops.head_proj import absorb_query, head_output

from .cache import write_rows
from .context import ForwardContext, causal_indices
from .indexer import Indexer
from .norms import RMSNorm
from .rope import apply_rope


# Queries per checkpointed chunk under train.recompute=attention: one chunk's recomputed intermediates and their
# gradients are about 4 * H * (C + R) bf16 per query (9 GiB at V3.2 shapes).
RECOMPUTE_CHUNK_TOKENS = 16384


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, role: str, source: int):
        super().__init__()
        self.layer_index, self.role, self.source = layer_index, role, source
        self.n_heads, self.kv_lora_rank, self.topk = cfg.n_heads, cfg.kv_lora_rank, cfg.index_topk
        self.index_fp8 = cfg.index_fp8
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.sm_scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        # S layers reuse their source's indices and carry no indexer weights at all.
        self.indexer = Indexer(cfg) if role == "F" else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [B, T, dim] (already attn_norm'ed) -> [B, T, dim]."""
        B, T, _ = x.shape
        H, C = self.n_heads, self.kv_lora_rank
        cos, sin = ctx.rope_mla
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(B, T, H, self.nope + self.rope)
        c_kv, k_pe = self.wkv_a(x).split([C, self.rope], dim=-1)
        if ctx.attn == "dense" and ctx.cache is None:
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            out = self._dense(x, q_latent, q_nope, apply_rope(q_pe, cos, sin), self.kv_norm(c_kv),
                              apply_rope(k_pe, cos, sin), ctx)
            if out is not None:
                return out
        kv = torch.cat([self.kv_norm(c_kv), apply_rope(k_pe, cos, sin)], dim=-1)  # [B, T, C + R]
        if ctx.cache is not None:
            kv = write_rows(ctx.cache.kv[self.layer_index], ctx.positions, kv)  # [B, max_context + 1, C + R]

        indices = self._indices(x, q_latent, kv.shape[1], ctx)
        # The recorder sees the attention once: a recomputation in backward finds the list empty.
        record = [] if ctx.recorder is None or ctx.attn == "dense" else [ctx.recorder]  # dense records in `_dense`
        if record and self.role == "F" and ctx.recorder.in_backward is not None:
            q = ctx.recorder.kl_after_attention(self.layer_index, q)  # its backward follows the group's attention's
        if ctx.recompute_attention and ctx.cache is None and torch.is_grad_enabled():
            return self.wo(self._attend_recomputed(q, kv, indices, cos, sin, ctx.recorder if record else None))
        record = [(r, None) for r in record]
        return self.wo(self._attend(q, kv, indices, cos, sin, record))

    def _attend_recomputed(self, q, kv, indices, cos, sin, recorder) -> torch.Tensor:
        """`_attend` in query chunks of RECOMPUTE_CHUNK_TOKENS, each checkpointed: the forward keeps only the
        inputs, and the backward rebuilds one chunk's intermediates at a time (a 128K-token layer's would be 34 GiB
        at once). Same shapes as `_attend`; each chunk records its rows of the indexer-loss target once."""
        B, T = q.shape[:2]
        step = max(1, RECOMPUTE_CHUNK_TOKENS // B)
        outs = []
        for t0, qc, ic, cc, sc in zip(range(0, T, step), q.split(step, 1), indices.split(step, 1),
                                       cos.split(step, 1), sin.split(step, 1)):
            record = [] if recorder is None else [(recorder, (t0, T))]
            outs.append(checkpoint(self._attend, qc, kv, ic, cc, sc, record, use_reentrant=False))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend(self, q, kv, indices, cos, sin, record: list) -> torch.Tensor:
        """Absorbed query, sparse attention, output up-projection: q [B, T, H, N + R] (q_pe not yet rotated), kv
        [B, S, C + R], indices [B, T, K] -> [B, T, H * V]. `record` holds at most one (recorder, rows) to hand the
        attention to (rows: (first row, total rows) of a query chunk, or None); it is emptied, so a recomputation
        in backward records nothing. The large intermediates, q_abs [B, T, H, C + R] and o_lat [B, T, H, C], are
        2 H C bf16 per token: 34 GiB per layer at 128K tokens, which `train.recompute=attention` does not keep."""
        H, C = q.shape[2], self.kv_lora_rank
        # The weight in the compute dtype (q's: bf16 under autocast, where einsum would cast it the same way); the
        # cast sits outside the projections so autograd returns the weight gradient in the parameter's dtype.
        w = self.wkv_b.weight.to(q.dtype).view(H, self.nope + self.v_dim, C)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_abs = absorb_query(q, w_uk, cos, sin)  # [q_nope @ W_UK | rope(q_pe)], written in place: no cat, one dq
        recorder, rows = record.pop() if record else (None, None)
        if recorder is not None and recorder.in_backward is not None:  # the attention backward fills the target
            o_lat, lse = sparse_mla(q_abs, kv, indices, self.sm_scale, C,
                                    probs_into=recorder.target_rows(self.layer_index, indices, rows))
        else:
            o_lat, lse = sparse_mla(q_abs, kv, indices, self.sm_scale, C)
            if recorder is not None:
                recorder.record_attention(self.layer_index, q_abs, kv, indices, lse, self.sm_scale, rows)
        return head_output(o_lat, w_uv)  # [B, T, H * V]; its backward hands sparse_mla a contiguous gradient

    def _dense(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, ctx: ForwardContext):
        """Dense attention without a cache, non-absorbed. q_nope [B, T, H, N], q_pe [B, T, H, R] and k_pe [B, T, R]
        (both rotated), c_kv [B, T, C] (normed). Records what the dense indexer loss needs; returns the layer output
        [B, T, dim], or None when the rows are not causal-aligned (the caller then runs sparse_mla over every key)."""
        B, T, H = q_nope.shape[0], q_nope.shape[1], self.n_heads
        kvb = self.wkv_b(c_kv).view(B, T, H, self.nope + self.v_dim)  # wkv_b.weight is [H, N + V, C]
        k_nope, v = kvb.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [B, T, H, N + R]
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype).unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)
        if ctx.recorder is not None:
            if self.role == "F":
                q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index)
                ctx.recorder.record_dense_index(self.layer_index, q_i, k_i, w_i, ctx.positions)
            ctx.recorder.record_dense_attention(self.layer_index, q, k, self.sm_scale)
        if not ctx.causal_rows:
            return None
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.sm_scale
        ).transpose(1, 2)  # [B, T, H, V]
        if not ctx.no_padding:  # a padding query (position < 0) sees no key: output 0, like sparse_mla over no index
            o = o * (ctx.positions >= 0).to(o.dtype).view(B, T, 1, 1)
        return self.wo(o.reshape(B, T, H * self.v_dim))

    def _indices(self, x: torch.Tensor, q_latent: torch.Tensor, num_keys: int, ctx: ForwardContext) -> torch.Tensor:
        """int32 [B, T, K]: the keys each query attends to (K = index_topk, or num_keys in dense mode)."""
        dense = ctx.attn == "dense"
        if self.role == "S":
            return causal_indices(ctx.positions, num_keys) if dense else ctx.index_slot.read(self.layer_index, self.source)
        if dense and ctx.cache is None:  # the indexer loss was recorded in `_dense`; nothing else uses the indexer
            return causal_indices(ctx.positions, num_keys)
        q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index)
        if ctx.cache is not None:  # F layers always keep their indexer keys current, whatever the attention mode
            k_i = write_rows(ctx.cache.index_k[self.layer_index], ctx.positions, k_i)
        if dense:  # with a cache: no recorder (training has no cache)
            return causal_indices(ctx.positions, num_keys)
        selected = indexer_topk(q_i, k_i, w_i, ctx.positions, self.topk, fp8=self.index_fp8)
        indices = ctx.index_slot.write(self.layer_index, selected)
        if ctx.recorder is not None:
            ctx.recorder.record_index_scores(self.layer_index, q_i, k_i, w_i, indices)
        return indices
