"""A pipeline stage of the DSA transformer, built from the plan.

`StageModule(model_cfg, plan, stage_index, seed=0)`:
  layers  nn.ModuleDict keyed by the GLOBAL layer index (str), each a DSABlock with the plan's role;
  embed   nn.Embedding(vocab, dim) on the first stage only (else None);
  norm    RMSNorm(dim) + head Linear(dim, vocab) on the last stage only (else None).
State-dict keys are therefore global and stable, e.g. `layers.5.attn.wkv_b.weight`, `layers.4.attn.indexer.wk.weight`
(docs/model.md lists them all).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from dsaflow.config.schema import ModelConfig
from dsaflow.plan.plan import Plan

from .block import DSABlock
from .cache import IndexSlot, StageCache
from .context import ATTN_MODES, ForwardContext
from .indexer_loss import IndexerLossRecorder
from .init import init_stage_weights
from .norms import RMSNorm
from .rope import rope_angles


class StageModule(nn.Module):
    def __init__(self, model_cfg: ModelConfig, plan: Plan, stage_index: int, seed: int = 0):
        super().__init__()
        self.cfg, self.stage_index = model_cfg, stage_index
        self.is_first, self.is_last = plan.is_first(stage_index), plan.is_last(stage_index)
        layer_ids = plan.stages[stage_index].layers
        for i in layer_ids:  # fail closed: an S layer may only reuse indices written earlier on this very stage
            lp = plan.layer(i)
            if lp.role == "S" and not (lp.source in layer_ids and lp.source < i and plan.layer(lp.source).role == "F"):
                raise ValueError(
                    f"plan: S layer {i} on stage {stage_index} has source={lp.source}, which is not an earlier F layer "
                    f"of the same stage (layers {list(layer_ids)}): rebuild plan.json with `dsaflow plan`, which "
                    f"promotes such layers to F."
                )
        self.layers = nn.ModuleDict({str(i): DSABlock(model_cfg, plan.layer(i)) for i in layer_ids})
        self.embed = nn.Embedding(model_cfg.vocab_size, model_cfg.dim) if self.is_first else None
        self.norm = RMSNorm(model_cfg.dim, model_cfg.norm_eps) if self.is_last else None
        self.head = nn.Linear(model_cfg.dim, model_cfg.vocab_size, bias=False) if self.is_last else None
        if model_cfg.tie_embeddings:
            if not (self.is_first and self.is_last):
                raise ValueError(
                    f"model.tie_embeddings=true needs the embedding and the LM head on one stage, but the plan has "
                    f"{plan.num_stages} stages: set model.tie_embeddings=false or use a single pipeline stage."
                )
            self.head.weight = self.embed.weight
        # Training-time indexer KL loss (see dsaflow.model.indexer_loss); the forward kwarg overrides the attribute.
        self.compute_indexer_loss = False
        self.indexer_loss: Optional[torch.Tensor] = None
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """Per-layer seeded init: stages built separately get exactly the PP=1 weights for the same seed."""
        init_stage_weights(self, seed, self.cfg.init_std)

    def forward(
        self,
        x: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[StageCache] = None,
        attn: str = "sparse",
        compute_indexer_loss: Optional[bool] = None,
    ) -> torch.Tensor:
        """x: token ids [B, T] int64 on the first stage, hidden [B, T, dim] otherwise.

        positions [B, T] int64 absolute positions (< 0 = padding query). Without a cache the keys are the T tokens
        themselves, token t at position t (default positions = arange(T)); with a cache positions are required and
        each token's rows are written at its position, then every query attends over the cached rows.
        attn: "sparse" (indexer top-k) | "dense" (all causal keys).
        Returns hidden [B, T, dim], or fp32 logits [B, T, vocab] on the last stage. Sets `self.indexer_loss`
        (scalar, graph only through indexer weights) when training with the indexer loss on, else None.
        With a cache: CUDA-graph safe (no host sync, static shapes given x.shape); run it under torch.no_grad().
        """
        if attn not in ATTN_MODES:
            raise ValueError(f"attn={attn!r} is not an attention mode: use one of {ATTN_MODES}.")
        h = self.embed(x) if self.embed is not None else x
        B, T = h.shape[:2]
        if positions is None:
            if cache is not None:
                raise ValueError("StageModule.forward with a cache needs positions [B, T] (absolute, < 0 = padding).")
            positions = torch.arange(T, device=h.device).expand(B, T)
        want_loss = self.compute_indexer_loss if compute_indexer_loss is None else compute_indexer_loss
        recorder = (IndexerLossRecorder(self.sources(), dense=attn == "dense")
                    if (want_loss and self.training and cache is None) else None)
        slot = cache.index_slot if cache is not None else IndexSlot()
        slot.begin()
        c = self.cfg
        ctx = ForwardContext(
            positions=positions,
            rope_mla=rope_angles(positions, c.qk_rope_head_dim, c.rope_theta),
            rope_index=rope_angles(positions, c.index_rope_head_dim, c.rope_theta),
            attn=attn,
            cache=cache,
            index_slot=slot,
            recorder=recorder,
        )
        for layer in self.layers.values():
            h = layer(h, ctx)
        self.indexer_loss = recorder.loss() if recorder is not None else None
        if self.head is not None:
            return self.head(self.norm(h)).float()
        return h

    def sources(self) -> List[tuple[int, int]]:
        """(layer, source) for every layer of the stage (source = itself for F layers)."""
        return [(layer.layer_index, layer.source) for layer in self.layers.values()]

    def indexer_parameters(self) -> List[nn.Parameter]:
        """The parameters the indexer loss trains (F layers' `attn.indexer.*`)."""
        return [p for n, p in self.named_parameters() if ".attn.indexer." in n]


def build_stages(model_cfg: ModelConfig, plan: Plan, seed: int = 0) -> List[StageModule]:
    """Every stage of `plan` on this process (tests, PP=1 references): stage i = StageModule(model_cfg, plan, i)."""
    return [StageModule(model_cfg, plan, i, seed) for i in range(plan.num_stages)]


def full_state_dict(stages: List[StageModule]) -> Dict[str, torch.Tensor]:
    """Union of the stages' state dicts: the keys are global, so stages never collide (except tied embeddings)."""
    out: Dict[str, torch.Tensor] = {}
    for s in stages:
        out.update(s.state_dict())
    return out


def load_full_state_dict(stage: StageModule, full: Dict[str, torch.Tensor]) -> None:
    """Load this stage's slice of a whole-model state dict (keys it does not own are ignored; missing ones raise)."""
    own = stage.state_dict().keys()
    missing = [k for k in own if k not in full]
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} keys of stage {stage.stage_index}, e.g. {missing[:3]}")
    stage.load_state_dict({k: full[k] for k in own}, strict=True)
