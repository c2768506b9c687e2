"""Deterministic, partition-independent weight init.

Every layer draws from its own CPU generator seeded by (seed, layer index), and its indexer from a separate one
seeded by (seed, layer index, "indexer"), so a layer gets the same weights whichever stage builds it (PP=1 vs PP=N)
and its non-indexer weights do not depend on its role. Embedding and head have their own generators; an MTP layer's embedding copy draws from the embedding's, so it starts
equal to the main embedding.
Linear / Embedding / MoE router and experts: normal(0, init_std) (the router's selection bias starts at 0); RMSNorm and LayerNorm weights: 1; LayerNorm bias: 0.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from .moe import Experts, Router


def _generator(seed: int, *tag) -> torch.Generator:
    digest = hashlib.sha256(repr((int(seed),) + tag).encode()).hexdigest()
    g = torch.Generator()
    g.manual_seed(int(digest[:15], 16))
    return g


@torch.no_grad()
def init_module(module: nn.Module, g: torch.Generator, std: float, skip: tuple[str, ...] = ()) -> None:
    """Initialise every parameter of `module` in registration order from `g` (submodules named in `skip` excluded)."""
    for name, m in module.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if isinstance(m, (nn.Linear, nn.Embedding, Router)):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
        elif isinstance(m, Experts):
            m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * std)
            m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * std)
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif hasattr(m, "weight") and isinstance(m.weight, nn.Parameter) and m.weight.dim() == 1:
            m.weight.fill_(1.0)  # RMSNorm


def init_stage_weights(stage: nn.Module, seed: int, std: float) -> None:
    """Initialise a StageModule in place; identical weights for the same seed however the layers are staged."""
    for key, layer in stage.layers.items():
        i = int(key)
        init_module(layer, _generator(seed, i), std, skip=("attn.indexer",))
        if layer.attn.indexer is not None:
            init_module(layer.attn.indexer, _generator(seed, i, "indexer"), std)
    for key, layer in (
        stage.mtp or {}
    ).items():  # an MTP layer: its block like a layer, its embedding copy the main one
        i = int(key)
        init_module(layer, _generator(seed, i), std, skip=("attn.indexer", "embed"))
        init_module(layer.attn.indexer, _generator(seed, i, "indexer"), std)
        init_module(layer.embed, _generator(seed, "embed"), std)
    if stage.embed is not None:
        init_module(stage.embed, _generator(seed, "embed"), std)
    if stage.norm is not None:
        init_module(stage.norm, _generator(seed, "norm"), std)
    if stage.head is not None and stage.head.weight is not getattr(stage.embed, "weight", None):
        init_module(stage.head, _generator(seed, "head"), std)
