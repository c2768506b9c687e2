"""Cutting the model into the plan's stages (the seam between the plan and the model, which knows nothing of plans).

A stage is a StageModule over the plan's layers of that stage (LayerPlan has the index / role / source the model
needs), with the embedding on stage 0 and the head on the last stage. Every layer draws its weights from its own
seeded generator, so stages built separately hold exactly the weights of the whole model (PP=1 == PP=N).
"""

from __future__ import annotations

from typing import List

import torch

from dsaflow.model import LayerSpec, StageCache, StageModule
from dsaflow.model.mtp import mtp_layer_indices
from dsaflow.plan.plan import Plan


def stage_layers(plan: Plan, stage: int) -> list:
    """The LayerPlans of stage `stage`, in order."""
    return [plan.layer(i) for i in plan.stages[stage].layers]


def stage_module(model_cfg, plan: Plan, stage: int, seed: int = 0) -> StageModule:
    """Stage `stage` of `plan` as a module (weights from `seed`, on CPU)."""
    return StageModule(
        model_cfg,
        stage_layers(plan, stage),
        plan.is_first(stage),
        plan.is_last(stage),
        seed,
        name=f"stage {stage}",
        receives_indices=plan.receives_indices(stage),
    )


def build_stages(model_cfg, plan: Plan, seed: int = 0) -> List[StageModule]:
    """Every stage of `plan` on this process (tests, PP=1 references, single-process serving)."""
    return [stage_module(model_cfg, plan, s, seed) for s in range(plan.num_stages)]


def stage_cache(
    model_cfg,
    plan: Plan,
    stage: int,
    max_batch: int,
    max_context: int,
    max_tokens: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_dtype: str = "bf16",
    mtp: bool = False,
) -> StageCache:
    """Preallocated serving caches of stage `stage` (see dsaflow.model.cache; kv_dtype: serve.kv_dtype); mtp: with
    rows for the model's MTP layers too (the last stage, speculative decoding)."""
    layers = stage_layers(plan, stage)
    if mtp:
        layers = layers + [LayerSpec(i, "F", i) for i in mtp_layer_indices(model_cfg)]
    return StageCache.allocate(model_cfg, layers, max_batch, max_context, max_tokens, device, dtype, kv_dtype)


def check_hf_checkpoint(cfg, plan: Plan, error=None) -> None:
    """Every tensor the plan's stages need is in model.hf_path with its shape and dtype (headers only, stages built
    on the meta device): a bad checkpoint stops the job before any process starts. Raises `error` (a PlanError
    type; default CheckpointError) naming model.hf_path."""
    from dsaflow.checkpoint.hf_weights import check_hf_weights
    from dsaflow.errors import CheckpointError

    with torch.device("meta"):
        stages = {sp.index: stage_module(cfg.model, plan, sp.index, seed=0) for sp in plan.stages}
    try:
        check_hf_weights(stages, cfg.model.hf_path, cfg.model)
    except CheckpointError as exc:
        raise (error or CheckpointError)(f"model.hf_path={cfg.model.hf_path}: {exc}") from None
