"""Multi-head latent attention (DeepSeek-V3 MLA), always computed in MQA (absorbed) mode through `sparse_mla`.

Shapes (H = n_heads, C = kv_lora_rank, R = qk_rope_head_dim, N = qk_nope_head_dim, V = v_head_dim):
  q_latent = q_norm(wq_a(x))                          [B, T, q_lora]
  q        = wq_b(q_latent) -> [q_nope | q_pe]        [B, T, H, N + R], RoPE on q_pe
  kv row   = [kv_norm(c_kv) | rope(k_pe)]             [B, S, C + R]   (wkv_a(x) = [c_kv | k_pe]; shared by all heads)
  wkv_b.weight viewed as [H, N + V, C]: W_UK = [:, :N], W_UV = [:, N:]
  q_abs    = [q_nope @ W_UK | q_pe]                   [B, T, H, C + R]   (d_qk = C + R)
  o_lat    = sparse_mla(q_abs, kv, indices, sm_scale=(N + R)^-0.5 [x YaRN mscale^2], d_v=C)  [B, T, H, C]
  out      = wo(o_lat @ W_UV^T)                       [B, T, dim]
The absorbed form is exactly the naive MLA (q_nope . (W_UK c) = (W_UK^T q_nope) . c), and it is the same computation
in training, prefill and decode. The indices come from the layer's own indexer (F), from the stage's index slot
written by its source (S), or are every causal key (attn="dense").

Dense attention without a cache (training, the dense warm-up) runs the non-absorbed form instead, per head
  q = [q_nope | rope(q_pe)] (N + R),  k = [W_UK c | rope(k_pe)] (N + R),  v = W_UV c (V),
through causal `scaled_dot_product_attention` (FlashAttention on GPU): no [B, T, S] index tensor, O(T) memory.
Its indexer loss uses the same per-head q and k (dsaflow.ops.dense_indexer_kl, streamed over key blocks).

Serving prefill chunks short enough that the indexer would keep (nearly) every key run the non-absorbed form too, over
the cached rows (dsaflow.model.dense_prefill, chosen on the host per pass).

`forward` picks one of three paths: `_forward_cached` (serving), `_forward_sparse` (training, top-k keys) and
`_forward_dense` (training's dense warm-up). Under `train.recompute=attention|block` the training paths run the
absorbed attention in checkpointed query chunks, so no [T, H, C + R] or [T, H, C] tensor is kept at full length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsaflow.config.kv_cache_format import index_key_format, latent_format
from dsaflow.config.rope_schema import softmax_mscale
from dsaflow.config.schema import ModelConfig
from dsaflow.ops import indexer_topk, sparse_mla
from dsaflow.ops.fp8_gemm import Fp8Activation, shared_fp8_input
from dsaflow.ops.head_proj import absorb_query, head_output

from .cache import flat_indices, flat_rows
from .cache_fp8 import write_cache_rows
from .context import ForwardContext, causal_indices
from .context_parallel import keys_regathered
from .dense_prefill import prefill_attention, rotate_query_pe_, zero_padding
from .fp8_weights import matrix_weight
from .indexer import Indexer
from .indexer_loss import kl_after_attention_replay
from .norms import RMSNorm
from .rope import apply_rope


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, role: str, source: int):
        super().__init__()
        self.layer_index, self.role, self.source = layer_index, role, source
        self.n_heads, self.kv_lora_rank, self.topk = cfg.n_heads, cfg.kv_lora_rank, cfg.index_topk
        self.index_fp8 = cfg.index_fp8
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        # YaRN sharpens the softmax by mscale^2 (1 without rope_scaling)
        self.sm_scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * softmax_mscale(cfg.rope_scaling)
        latent_eps = cfg.norm_eps if cfg.latent_norm_eps is None else cfg.latent_norm_eps
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, latent_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, latent_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        # the packed rows of an FP8 serving cache (serve.kv_dtype=fp8; dsaflow.model.cache_fp8)
        self.kv_fmt, self.key_fmt = latent_format(cfg), index_key_format(cfg)
        # S layers reuse their source's indices and carry no indexer weights at all.
        self.indexer = Indexer(cfg) if role == "F" else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [B, T, dim] (already attn_norm'ed) -> [B, T, dim]. One of three paths, each read top to bottom. With FP8
        weights, wq_a, wkv_a and the indexer's wk read one quantization of x, x_fp8 (`shared_fp8_input`; None where
        no GEMM reads a separate one: bf16 weights, the CPU reference, decode's fused launches)."""
        x_fp8 = shared_fp8_input(x, *self._reads_x())
        if ctx.cached:
            return self._forward_cached(x, x_fp8, ctx)
        if ctx.attn == "dense":
            return self._forward_dense(x, x_fp8, ctx)
        return self._forward_sparse(x, x_fp8, ctx)

    def _reads_x(self) -> list[torch.Tensor]:
        """The weights of the projections whose input is the layer's x: wq_a, wkv_a and, on F layers, the
        indexer's wk (the indexer's weights_proj is never FP8)."""
        return [self.wq_a.weight, self.wkv_a.weight, *(() if self.indexer is None else (self.indexer.wk.weight,))]

    def _project(self, x: torch.Tensor, x_fp8: Fp8Activation | None):
        """x [B, T, dim] (or its quantization x_fp8) -> q_latent [B, T, q_lora], q [B, T, H, N + R] (q_pe not
        rotated), c_kv [B, T, C], k_pe [B, T, R] (neither normed nor rotated)."""
        B, T, _ = x.shape
        gemm_input = x if x_fp8 is None else x_fp8
        q_latent = self.q_norm(self.wq_a(gemm_input))
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.nope + self.rope)
        c_kv, k_pe = self.wkv_a(gemm_input).split([self.kv_lora_rank, self.rope], dim=-1)
        return q_latent, q, c_kv, k_pe

    def _latent_rows(self, c_kv: torch.Tensor, k_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The MQA key/value rows [B, T, C + R] = [kv_norm(c_kv) | rope(k_pe)]."""
        cos, sin = ctx.rope_mla
        return torch.cat([self.kv_norm(c_kv), apply_rope(k_pe, cos, sin)], dim=-1)

    # ---- serving: a cache, no gradient, no indexer loss ----
    def _forward_cached(self, x: torch.Tensor, x_fp8: Fp8Activation | None, ctx: ForwardContext) -> torch.Tensor:
        """Write this chunk's latent rows (and, on F layers, indexer keys) at their positions, then attend over the
        cached rows: the top-k keys (sparse) or every causal key (dense). A short prefill chunk (`ctx.prefill`, see
        dsaflow.model.dense_prefill) attends over the non-absorbed heads instead. CUDA-graph safe."""
        if ctx.token_rows is not None:
            return self._forward_token_major(x, x_fp8, ctx)
        cos, sin = ctx.rope_mla
        q_latent, q, c_kv, k_pe = self._project(x, x_fp8)
        kv = write_cache_rows(
            ctx.cache.kv[self.layer_index], ctx.slots, self._latent_rows(c_kv, k_pe, ctx), self.kv_fmt
        )
        num_keys = kv.shape[1]  # max_context + 1
        hint = ctx.prefill
        if hint is not None and hint.path == "dense":  # the top-k would select every visible key: none is computed
            if self.role == "F":  # decode reads these keys
                keys = self.indexer.keys(x, ctx.rope_index, x_fp8)
                write_cache_rows(ctx.cache.index_k[self.layer_index], ctx.slots, keys, self.key_fmt)
            q = rotate_query_pe_(q, cos, sin, self.nope)
            return zero_padding(self.wo(prefill_attention(self, q, kv, ctx.positions, hint)), ctx.positions)
        if self.role == "F":  # F layers keep their indexer keys current, whatever the attention mode
            q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index, x_fp8)
            k_i = write_cache_rows(ctx.cache.index_k[self.layer_index], ctx.slots, k_i, self.key_fmt)
        if ctx.attn == "dense":
            indices = causal_indices(ctx.positions, num_keys)
        elif self.role == "F":
            selected = self._select(q_i, k_i, w_i, ctx.positions, hint.dense_cols if hint is not None else 0)
            indices = ctx.index_slot.write(self.layer_index, selected)
        else:
            indices = ctx.index_slot.read(self.layer_index, self.source)
        if hint is not None and hint.path == "split":  # dense, then masked columns; the rest sparse
            E, pos = hint.short_cols, ctx.positions
            q_short = rotate_query_pe_(q[:, :E], cos[:, :E], sin[:, :E], self.nope)  # columns E.. stay unrotated
            head = self.wo(prefill_attention(self, q_short, kv, pos[:, :E], hint, indices[:, :E]))
            head = zero_padding(head, pos[:, :E])
            if E == q.shape[1]:
                return head
            tail = self._attend(q[:, E:], kv, indices[:, E:], cos[:, E:], sin[:, E:])
            return torch.cat([head, self.wo(tail)], dim=1)  # [B, T, dim]: half the bytes of [B, T, H V]
        if hint is not None:  # masked: the same keys as the sparse path, over the non-absorbed heads
            q = rotate_query_pe_(q, cos, sin, self.nope)
            out = self.wo(prefill_attention(self, q, kv, ctx.positions, hint, indices))
            return zero_padding(out, ctx.positions)
        return self.wo(self._attend(q, kv, indices, cos, sin))

    def _forward_token_major(self, x: torch.Tensor, x_fp8: Fp8Activation | None, ctx: ForwardContext) -> torch.Tensor:
        """`_forward_cached` of a token-major pass (`ctx.token_rows`: x [B, T, dim] holds tokens of many cache rows):
        writes go to the flat view of the rows ([1, rows x (max_context + 1), D], `cache.flat_rows`), the indexer
        scores each query against its own row's keys (`indexer_topk(key_rows=)`), and the row-local indices are
        offset into the flat view for the attention, so a token sees exactly what it would see in a [rows, T] pass.
        Sparse or dense attention; no short-prefill hint (StageModule refuses one)."""
        cos, sin = ctx.rope_mla
        rows, cache = ctx.token_rows, ctx.cache
        q_latent, q, c_kv, k_pe = self._project(x, x_fp8)
        kv = write_cache_rows(
            flat_rows(cache.kv[self.layer_index]), ctx.slots, self._latent_rows(c_kv, k_pe, ctx), self.kv_fmt
        )
        num_keys = cache.max_context + 1  # per row
        if self.role == "F":
            q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index, x_fp8)
            write_cache_rows(flat_rows(cache.index_k[self.layer_index]), ctx.slots, k_i, self.key_fmt)
        if ctx.attn == "dense":
            indices = causal_indices(ctx.positions, num_keys)
        elif self.role == "F":
            keys = cache.index_k[self.layer_index]
            selected = indexer_topk(q_i, keys, w_i, ctx.positions, self.topk, fp8=self.index_fp8, key_rows=rows)
            indices = ctx.index_slot.write(self.layer_index, selected)
        else:
            indices = ctx.index_slot.read(self.layer_index, self.source)
        return self.wo(self._attend(q, kv, flat_indices(indices, rows, num_keys), cos, sin))

    def _select(self, q_i, k_i, w_i, positions, dense_cols: int) -> torch.Tensor:
        """The top-k [B, T, K] of a serving pass; with dense_cols (a split pass) only columns [dense_cols, T) are
        scored, and the first columns, which attend densely and whose indices nobody reads, hold -1."""
        if not dense_cols:
            return indexer_topk(q_i, k_i, w_i, positions, self.topk, fp8=self.index_fp8)
        D = dense_cols
        tail = indexer_topk(
            q_i[:, D:].contiguous(), k_i, w_i[:, D:].contiguous(), positions[:, D:], self.topk, fp8=self.index_fp8
        )
        return torch.cat([tail.new_full((tail.shape[0], D, tail.shape[2]), -1), tail], dim=1)

    # ---- training / full-sequence forward, sparse attention ----
    def _forward_sparse(self, x: torch.Tensor, x_fp8: Fp8Activation | None, ctx: ForwardContext) -> torch.Tensor:
        """Top-k sparse attention over the T tokens themselves. F layers run the indexer and write the stage's
        indices; S layers read them. With a recorder the indexer loss is fed: F layers hand over their indexer
        outputs, every layer its attention (in the forward, or through `probs_into` in the backward).

        Inside a recomputed block (`ctx.replay`) the layer's second run repeats the first one's computation (the
        same saved tensors, in the same order) without its side effects: the indices come from the first run, and
        neither the index slot nor the recorder is touched again.

        Context parallel (`ctx.cp`): x holds this rank's tokens; the latent rows and indexer keys of every rank are
        gathered (global key order), and what autograd saves of them is gathered again in backward
        (dsaflow.model.context_parallel)."""
        if ctx.cp is None:
            return self._sparse_attention(x, x_fp8, ctx, None)
        with keys_regathered(ctx.cp, replaced=ctx.replay is None) as keys:
            return self._sparse_attention(x, x_fp8, ctx, keys.gather)

    def _sparse_attention(self, x, x_fp8, ctx: ForwardContext, gather) -> torch.Tensor:
        """`_forward_sparse`'s body; gather: None, or the cp gather of key rows [B, t, D] -> [B, T, D]."""
        cos, sin = ctx.rope_mla
        replaying = ctx.replay is not None and ctx.replay.replaying
        recorder = None if replaying else ctx.recorder
        q_latent, q, c_kv, k_pe = self._project(x, x_fp8)
        kv = self._latent_rows(c_kv, k_pe, ctx)
        kv = kv if gather is None else gather(kv)
        if self.role == "F":
            q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index, x_fp8)
            k_i = k_i if gather is None else gather(k_i)
            if replaying:
                indices = ctx.replay.indices
            else:
                selected = indexer_topk(q_i, k_i, w_i, ctx.positions, self.topk, fp8=self.index_fp8)
                indices = ctx.index_slot.write(self.layer_index, selected)
            if recorder is not None:
                recorder.record_index_scores(self.layer_index, q_i, k_i, w_i, indices)
            in_backward = ctx.recorder is not None and ctx.recorder.in_backward is not None
            if in_backward:  # the KL's backward follows its group's attention backward (dsaflow.model.indexer_loss)
                q = (
                    kl_after_attention_replay(q, q_i, k_i, w_i)
                    if replaying
                    else recorder.kl_after_attention(self.layer_index, q)
                )
        else:
            indices = ctx.replay.indices if replaying else ctx.index_slot.read(self.layer_index, self.source)
        if ctx.replay is not None and not replaying:
            ctx.replay.indices = indices
        return self.wo(self._attend_training(q, kv, indices, cos, sin, recorder, ctx))

    # ---- training / full-sequence forward, dense attention (the dense warm-up) ----
    def _forward_dense(self, x: torch.Tensor, x_fp8: Fp8Activation | None, ctx: ForwardContext) -> torch.Tensor:
        """Every causal key, non-absorbed, per head: q = [q_nope | rope(q_pe)] (N + R), k = [W_UK c | rope(k_pe)]
        (N + R), v = W_UV c (V). With a recorder, F layers hand over their indexer outputs and every layer its
        per-head q and k (the dense indexer loss streams over them). Causal rows run causal SDPA (FlashAttention on
        GPU, O(T) memory); other rows (caller-given positions) run sparse_mla over every causal key."""
        B, T, _ = x.shape
        H = self.n_heads
        cos, sin = ctx.rope_mla
        replaying = ctx.replay is not None and ctx.replay.replaying
        recorder = None if replaying else ctx.recorder
        q_latent, q, c_kv, k_pe = self._project(x, x_fp8)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe, c_kv_normed, k_pe_rot = apply_rope(q_pe, cos, sin), self.kv_norm(c_kv), apply_rope(k_pe, cos, sin)
        kvb = self.wkv_b(c_kv_normed).view(B, T, H, self.nope + self.v_dim)  # wkv_b.weight is [H, N + V, C]
        k_nope, v = kvb.split([self.nope, self.v_dim], dim=-1)
        q_heads = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [B, T, H, N + R]
        k_heads = torch.cat([k_nope, k_pe_rot.to(k_nope.dtype).unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)
        if ctx.recorder is not None:
            if self.role == "F":
                q_i, k_i, w_i = self.indexer(x, q_latent, ctx.rope_index, x_fp8)
                if recorder is not None:
                    recorder.record_dense_index(self.layer_index, q_i, k_i, w_i, ctx.positions)
            if recorder is not None:
                recorder.record_dense_attention(self.layer_index, q_heads, k_heads, self.sm_scale)
        if not ctx.causal_rows:
            kv = self._latent_rows(c_kv, k_pe, ctx)
            indices = causal_indices(ctx.positions, kv.shape[1])
            return self.wo(self._attend_training(q, kv, indices, cos, sin, None, ctx))
        o = F.scaled_dot_product_attention(
            q_heads.transpose(1, 2), k_heads.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.sm_scale
        ).transpose(1, 2)  # [B, T, H, V]
        if not ctx.no_padding:  # a padding query (position < 0) sees no key: output 0, like sparse_mla over no index
            o = o * (ctx.positions >= 0).to(o.dtype).view(B, T, 1, 1)
        return self.wo(o.reshape(B, T, H * self.v_dim))

    # ---- the absorbed attention ----
    def _attend_training(self, q, kv, indices, cos, sin, recorder, ctx: ForwardContext) -> torch.Tensor:
        """`_attend` without a cache: in checkpointed query chunks when recomputing (`chunked_attention`), else at
        once. [B, T, H * V]."""
        chunk = ctx.recompute_chunk_tokens
        if torch.is_grad_enabled() and chunked_attention(ctx.recompute, q.shape[0] * q.shape[1], chunk):
            return self._attend_chunked(q, kv, indices, cos, sin, recorder, chunk)
        return self._attend(q, kv, indices, cos, sin, recorder)

    def _attend_chunked(self, q, kv, indices, cos, sin, recorder, chunk_tokens: int) -> torch.Tensor:
        """`_attend` in query chunks of `chunk_tokens` queries (over the batch), each checkpointed: the forward keeps
        only the inputs, and the backward rebuilds one chunk's intermediates at a time (a 128K-token layer's would be
        34 GiB at once). Same shapes as `_attend`; each chunk hands its rows of the attention to the recorder once (its
        recomputation in backward gets none)."""
        B, T = q.shape[:2]
        step = max(1, chunk_tokens // B)
        outs = []
        for t0, qc, ic, cc, sc in zip(
            range(0, T, step), q.split(step, 1), indices.split(step, 1), cos.split(step, 1), sin.split(step, 1)
        ):
            first_run = _FirstRunOnly(recorder)
            outs.append(checkpoint(self._attend_chunk, qc, kv, ic, cc, sc, first_run, (t0, T), use_reentrant=False))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend_chunk(self, q, kv, indices, cos, sin, first_run: _FirstRunOnly, rows) -> torch.Tensor:
        return self._attend(q, kv, indices, cos, sin, first_run.take(), rows)

    def _attend(self, q, kv, indices, cos, sin, recorder=None, rows=None) -> torch.Tensor:
        """Absorbed query, sparse attention, output up-projection: q [B, T, H, N + R] (q_pe not yet rotated), kv
        [B, S, C + R], indices [B, T, K] -> [B, T, H * V]. recorder: the indexer-loss recorder that receives this
        attention (None: nothing recorded); rows = (first row, total rows) when q is a query chunk. The large
        intermediates, q_abs [B, T, H, C + R] and o_lat [B, T, H, C], are 2 H C bf16 per token: 34 GiB per layer at
        128K tokens, which the recompute modes keep only one chunk of."""
        H, C = q.shape[2], self.kv_lora_rank
        # The weight in the compute dtype (q's: bf16 under autocast, where einsum would cast it the same way); the
        # cast sits outside the projections so autograd returns the weight gradient in the parameter's dtype.
        w = matrix_weight(self.wkv_b, q.dtype).view(H, self.nope + self.v_dim, C)  # FP8: dequantized per call
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_abs = absorb_query(q, w_uk, cos, sin)  # [q_nope @ W_UK | rope(q_pe)], written in place: no cat, one dq
        if recorder is None:
            o_lat, _ = sparse_mla(q_abs, kv, indices, self.sm_scale, C)
        elif recorder.in_backward is not None:  # the attention backward fills the target
            o_lat, _ = sparse_mla(
                q_abs, kv, indices, self.sm_scale, C, probs_into=recorder.target_rows(self.layer_index, indices, rows)
            )
        else:
            o_lat, lse = sparse_mla(q_abs, kv, indices, self.sm_scale, C)
            recorder.record_attention(self.layer_index, q_abs, kv, indices, lse, self.sm_scale, rows)
        return head_output(o_lat, w_uv)  # [B, T, H * V]; its backward hands sparse_mla a contiguous gradient


def chunked_attention(recompute: str, queries: int, chunk_tokens: int) -> bool:
    """Whether a layer's attention runs in checkpointed query chunks. `attention`: always (the forward keeps only
    the attention inputs). `block`: only when the queries exceed one chunk; below that the block's recomputation
    already bounds the transient by the chunk budget, and a second recomputation of the attention would cost time."""
    return recompute == "attention" or (recompute == "block" and queries > chunk_tokens)


class _FirstRunOnly:
    """Hands out its value once: a checkpointed function's recomputation in backward must not record again."""

    def __init__(self, value):
        self.value = value

    def take(self):
        value, self.value = self.value, None
        return value
