"""One DSA transformer block (pre-norm residual): h += MLA(attn_norm(h)); h += MLP(ffn_norm(h)), the MLP a dense
SwiGLU or, on the MoE layers of a model with `model.moe`, a mixture of experts (`moe.py`).

A block's place in the IndexCache layout is a `LayerSpec`: F blocks own an indexer (`attn.indexer`), S blocks read
the indices their source wrote earlier in the same forward. The model knows nothing of plans: the planner's
`LayerPlan` carries the same three fields, so the runtime passes a plan's layers as they are.

Under `train.recompute=block` a training forward keeps only the block's input: the block runs inside a
non-reentrant `torch.utils.checkpoint`, and its backward runs the block again (`LayerReplay` makes that second run
side-effect free) before backpropagating through it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.config.schema import ModelConfig

from .context import ForwardContext, LayerReplay
from .layer_spec import LayerSpec
from .mla import MLA
from .moe import MoE
from .norms import RMSNorm
from .swiglu import SwiGLU


class DSABlock(nn.Module):
    """`DSABlock(cfg)` is layer 0 as an F layer; pass a LayerSpec (or any object with index/role/source) otherwise."""

    def __init__(self, cfg: ModelConfig, layer: LayerSpec = LayerSpec()):  # noqa: B008 - frozen, never mutated
        super().__init__()
        if layer.role not in ("F", "S"):
            raise ValueError(f"layer {layer.index}: role={layer.role!r} must be 'F' or 'S'.")
        source = layer.index if layer.source is None else layer.source
        if layer.role == "S" and source >= layer.index:
            raise ValueError(f"S layer {layer.index} has source={source}: a source must be an earlier F layer.")
        self.layer_index, self.role, self.source = layer.index, layer.role, source
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg, layer.index, layer.role, source)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg.dim, cfg.moe) if is_moe_layer(cfg, layer.index) else SwiGLU(cfg.dim, cfg.inter_dim)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """h [B, T, dim] -> [B, T, dim]."""
        if not ctx.cached and ctx.recompute == "block" and self._main_path_learns(h):
            replay = LayerReplay()
            out = checkpoint(self._forward, h, dataclasses.replace(ctx, replay=replay), use_reentrant=False)
            replay.replaying = True  # from here on, only the backward's recomputation runs `_forward` again
            return out
        return self._forward(h, ctx)

    def _main_path_learns(self, h: torch.Tensor) -> bool:
        """A forward without a cache whose backward runs through this block (its input or its weights need
        gradient). The dense warm-up freezes the main weights and feeds inputs without gradient: autograd then saves
        nothing of the block but the indexer's small graph, so there is nothing to recompute."""
        return torch.is_grad_enabled() and (h.requires_grad or self.attn_norm.weight.requires_grad)

    def _forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), ctx)
        if isinstance(self.mlp, MoE):  # a recomputation in backward must not count the tokens twice
            record = not ctx.cached and ctx.record_expert_load
            count = record and (ctx.replay is None or not ctx.replay.replaying)
            real = ctx.positions >= 0 if record else None
            return h + self.mlp(self.ffn_norm(h), count, record, real)
        return h + self.mlp(self.ffn_norm(h))
