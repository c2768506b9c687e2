"""Whether a serving plan fits its device, and what to change when it does not: `dsaflow plan mode=serve` against
plan.device_memory_gib (exit 2), and the fix hints of the pre-launch check of `dsaflow generate`."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from dsaflow.config.fp8_policy import FP8
from dsaflow.errors import PlanError, ResourceError
from dsaflow.plan.serve_memory import (
    KV,
    USABLE_FRACTION,
    WEIGHTS,
    gib_text,
    largest_term,
    plan_device_bytes,
    rank_fits,
    serve_fix,
    serve_width,
)


def plan_fits(cfg, usable: float, width: int) -> bool:
    """Whether every rank of cfg's plan fits `usable` bytes (a config the planner refuses does not fit)."""
    from dsaflow.plan.planner import build_plan

    try:
        plan = build_plan(cfg)
    except PlanError:
        return False
    return all(f.fits for f in rank_fits(cfg, plan.layers, plan.stages, width, usable))


def fewest_fitting_ranks(cfg, usable: float, width: int) -> Optional[str]:
    """The overrides of the fewest pipeline ranks above the current count whose every rank fits `usable` bytes, each
    rank keeping its number of stages and the planner cutting them as pipeline.balance says: 'pipeline.stages=13',
    or 'pipeline.ranks=5 pipeline.stages=10' for 2 stages per rank. "" when even one layer per stage does not fit;
    None when the stages are fixed by a layout or pipeline.boundaries (not searched)."""
    p = cfg.pipeline
    if cfg.layout is not None or p.boundaries is not None:
        return None
    ranks = p.stages if p.ranks is None else p.ranks
    per_rank = max(1, p.stages // ranks)
    for r in range(ranks + 1, cfg.model.num_layers // per_rank + 1):
        pipeline = dataclasses.replace(p, stages=r * per_rank, ranks=None if p.ranks is None else r, microbatches=None)
        if plan_fits(dataclasses.replace(cfg, pipeline=pipeline), usable, width):
            return (
                f"pipeline.stages={r * per_rank}"
                if p.ranks is None
                else f"pipeline.ranks={r} pipeline.stages={r * per_rank}"
            )
    return ""


def fit_alternatives(cfg, usable: float, width: int) -> Tuple[Optional[str], Optional[bool]]:
    """(`fewest_fitting_ranks`, whether serve.weights=fp8 alone fits: None when serving fp8 already)."""
    fp8 = None
    if str(cfg.serve.weights) != FP8:
        fp8 = plan_fits(dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, weights=FP8)), usable, width)
    return fewest_fitting_ranks(cfg, usable, width), fp8


def check_serve_fit(cfg, plan) -> None:
    """`dsaflow plan mode=serve`: raise ResourceError when a rank's weights, work buffers and the KV caches the config
    asks exceed the usable share of plan.device_memory_gib, naming the largest term and what shrinks it."""
    usable = USABLE_FRACTION * plan_device_bytes(cfg)
    width = serve_width(str(cfg.serve.dtype))
    fits = rank_fits(cfg, plan.layers, plan.stages, width, usable)
    over = [f for f in fits if not f.fits]
    if not over:
        return
    worst = max(over, key=lambda f: f.need)
    name, biggest = largest_term(worst.terms)
    where = f"stage {worst.stages[0]}" if len(worst.stages) == 1 else f"stages {worst.stages}"
    others = f" ({len(over)} of {len(fits)} ranks are over)" if len(over) > 1 else ""
    sv = cfg.serve
    fix = serve_fix(cfg, worst, fits, name, *fit_alternatives(cfg, usable, width))
    raise ResourceError(
        f"serving {cfg.model.name} with serve.weights={sv.weights}: rank {worst.rank} ({where}) needs "
        f"{gib_text(worst.need)}, more than the {gib_text(usable)} usable of plan.device_memory_gib="
        f"{cfg.plan.device_memory_gib:.4g} ({USABLE_FRACTION:.0%}){others}: weights {gib_text(worst.terms[WEIGHTS])}, "
        f"work buffers {gib_text(worst.work)}, KV caches {gib_text(worst.terms[KV])} for serve.max_batch={sv.max_batch} x "
        f"serve.max_context={sv.max_context}. The largest term is {name} ({gib_text(biggest)}). Fix: {fix}; or plan "
        "for a device with more memory (plan.device_memory_gib)."
    )
