"""The planner: a composed config in, a checked `Plan` out. Pure Python: no torch.distributed, no GPU.

Rules (docs/planning.md), in the order they are applied:
  1. every layer gets a declared role (layout | index.pattern | index.freq | all F) and a stage;
  2. each S layer's source is the nearest preceding F on its stage; a stage whose first layer is S promotes it to F
     (fail closed: without cross-stage indices there is no cache to reuse), and says why;
  3. with pipeline.cross_stage_indices an S layer opening a stage reads the nearest preceding F of the whole model
     and the boundary carries the indices (`Plan.index_boundaries`); with index.promote=false and no crossing,
     every stage starts on F (partition.py). The estimates report, per boundary, the index payload next to the
     indexer work it avoids;
  4. graph blocks must exist where requested (see graph_blocks.py);
  5. per-stage estimates (see stage_estimates.py);
  6. every mistake is a PlanError naming the field, the value and the fix.
"""

from __future__ import annotations

from typing import List, Tuple

from dsaflow.config.kv_cache_format import FP8 as FP8_KV
from dsaflow.config.kv_cache_format import fp8_kv_problem
from dsaflow.errors import PlanError
from dsaflow.plan.cp_rules import check_context_parallel
from dsaflow.plan.graph_blocks import plan_graph_blocks
from dsaflow.plan.partition import (
    cost_balance,
    declared_roles,
    f_aligned,
    stage_of_layers,
    stage_starts,
    unconstrained_starts,
)
from dsaflow.plan.plan import LayerPlan, Plan, StagePlan
from dsaflow.plan.schedule import check_sharded_training, resolve_pipeline, stage_ranks
from dsaflow.plan.stage_estimates import build_estimates, layer_costs, promotion_costs


def check_fields(cfg) -> None:
    """Every declared range and choice (dsaflow.config.schema.validate: compose runs it too, this covers configs
    built in code), then the planner's cross-field rules on single groups."""
    from dsaflow.config.schema import validate

    validate(cfg)
    m = cfg.model
    if m.index_rope_head_dim > m.index_head_dim:
        raise PlanError(
            f"model.index_rope_head_dim={m.index_rope_head_dim} exceeds model.index_head_dim={m.index_head_dim} "
            f"(RoPE rotates part of the index head). Fix: e.g. model.index_rope_head_dim="
            f"{min(64, m.index_head_dim // 2 * 2)}."
        )
    if str(cfg.serve.kv_dtype) == FP8_KV and (problem := fp8_kv_problem(m)) is not None:
        raise PlanError(
            f"serve.kv_dtype=fp8 stores the caches in DeepSeek's packed FP8 rows, but {problem} (each fp32 scale "
            "covers a whole block of e4m3 values at a 4-byte aligned offset). Fix: serve.kv_dtype=bf16 for this model."
        )


def resolve_layers(
    roles: Tuple[str, ...], stage_of: List[int], cross_stage: bool = False, promote: bool = True
) -> Tuple[LayerPlan, ...]:
    """Sources and promotions (rules 2 and 3). Walks the layers once, remembering the last F seen on the current
    stage and in the whole model. cross_stage: an S layer that opens a stage reads the nearest preceding F of the
    whole model (its indices cross the boundary). promote=False: an S layer is never run as F."""
    out: List[LayerPlan] = []
    last_f_here, last_f_any, prev_stage = None, None, -1
    for i, (declared, stage) in enumerate(zip(roles, stage_of)):
        if stage != prev_stage:
            last_f_here, prev_stage = None, stage
        if declared == "F":
            out.append(LayerPlan(i, stage, "F", "F", False, i))
            last_f_here = last_f_any = i
        elif last_f_here is None and cross_stage and last_f_any is not None:
            out.append(LayerPlan(i, stage, "S", "S", False, last_f_any))  # indices arrive from an earlier stage
            last_f_here = last_f_any
        elif last_f_here is None:  # an S that opens its stage: nothing on this stage to reuse
            if not promote:
                raise _unsourced_s(i)
            where = (
                f"its nearest F (layer {last_f_any}) is on stage {stage_of[last_f_any]}"
                if last_f_any is not None
                else "no F layer precedes it"
            )
            crossing = "" if last_f_any is None else " and indices do not cross stages"
            why = f"declared S but first layer of stage {stage}; {where}{crossing}, so it runs its own indexer"
            out.append(LayerPlan(i, stage, "S", "F", True, i, why))
            last_f_here = i  # not last_f_any without crossing: the reason names the declared F the user meant
            if cross_stage:  # only layer 0 gets here: later stages read its indices like any F layer's
                last_f_any = i
        else:
            out.append(LayerPlan(i, stage, "S", "S", False, last_f_here))
    return tuple(out)


def _unsourced_s(i: int) -> PlanError:
    return PlanError(
        f"layer {i} is declared S but no F layer precedes it, and index.promote=false says S layers have no indexer "
        f"weights, so it has no indices to read. Fix: declare layer {i} F (the first layer of a model always runs "
        f"the indexer), or index.promote=true if the checkpoint has indexer weights on layer {i}."
    )


def index_boundaries(layers: Tuple[LayerPlan, ...], stages) -> Tuple[int, ...]:
    """The stages whose boundary to the next stage carries top-k indices: the next stage opens on an S layer whose
    source lies on an earlier stage (only with pipeline.cross_stage_indices)."""
    return tuple(st.index for st, nxt in zip(stages, stages[1:]) if layers[nxt.layers[0]].role == "S")


def build_plan(cfg, nproc=None) -> Plan:
    """Resolve and check `cfg` (a DSAFlowConfig); raises PlanError on any config or plan mistake.
    nproc: the process count the command was asked to launch (`dsaflow train --nproc N`); None = pipeline ranks x
    parallel.dp."""
    check_fields(cfg)
    n = cfg.model.num_layers
    cross = bool(cfg.pipeline.cross_stage_indices)
    roles, layout_starts = declared_roles(cfg)
    if roles[0] == "S" and not cfg.index.promote:
        raise _unsourced_s(0)
    costs = layer_costs(cfg, roles)
    # With cross-stage indices an S layer opening a stage stays S: it costs the split nothing extra.
    opening = [0.0] * n if cross else promotion_costs(cfg, roles)
    starts = stage_starts(cfg, layout_starts, costs, opening, roles)
    stage_of = stage_of_layers(starts, n)
    pipeline = resolve_pipeline(
        cfg.pipeline,
        len(starts),
        mode=cfg.mode,
        batch_size=cfg.train.batch_size,
        nproc=nproc,
        parallel=getattr(cfg, "parallel", None),
    )
    check_context_parallel(cfg, pipeline)
    check_sharded_training(cfg, pipeline)
    ranks = stage_ranks(len(starts), pipeline)
    bounds = list(starts[1:]) + [n]
    stages = tuple(StagePlan(s, ranks[s], tuple(range(starts[s], bounds[s]))) for s in range(len(starts)))
    layers = resolve_layers(roles, stage_of, cross, bool(cfg.index.promote))
    blocks = plan_graph_blocks(cfg, stage_of, len(stages))
    estimates = build_estimates(cfg, layers, stages, pipeline)
    carrying = index_boundaries(layers, stages)
    for b in estimates["boundaries"]:
        b["carries_indices"] = b["after_stage"] in carrying
    if f_aligned(cfg) and layout_starts is None and cfg.pipeline.boundaries is None and len(starts) > 1:
        # how much the F-only boundaries cost against a split free to cut anywhere (cross-stage indices)
        free = unconstrained_starts(costs, len(starts))
        estimates["f_aligned_split"] = {
            "balance": cost_balance(costs, starts),
            "balance_anywhere": cost_balance(costs, free),
            "starts_anywhere": list(free),
        }
    return Plan(
        num_layers=n,
        stages=stages,
        layers=layers,
        graph_blocks=blocks,
        pipeline=pipeline,
        estimates=estimates,
        index_boundaries=carrying,
    )
