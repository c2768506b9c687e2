"""The planner: a composed config in, a checked `Plan` out. Pure Python: no torch.distributed, no GPU.

Rules (DESIGN.md), in the order they are applied:
  1. every layer gets a declared role (layout | index.pattern | index.freq | all F) and a stage;
  2. each S layer's source is the nearest preceding F on its stage; a stage whose first layer is S promotes it to F
     (fail closed: indices never cross a stage, so there is no cache to reuse), and says why;
  3. cross-stage index transfer stays off; the estimates report its payload next to the recompute it would avoid;
  4. graph blocks must exist where requested (see graph_blocks.py);
  5. per-stage estimates (see stage_estimates.py);
  6. every mistake is a PlanError naming the field, the value and the fix.
"""
from __future__ import annotations

from typing import List, Tuple

from dsaflow.errors import PlanError
from dsaflow.plan.graph_blocks import plan_graph_blocks
from dsaflow.plan.partition import declared_roles, stage_of_layers, stage_starts
from dsaflow.plan.plan import LayerPlan, Plan, StagePlan
from dsaflow.plan.schedule import resolve_pipeline, stage_ranks
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


def resolve_layers(roles: Tuple[str, ...], stage_of: List[int]) -> Tuple[LayerPlan, ...]:
    """Sources and promotions (rule 2). Walks the layers once, remembering the last F seen on the current stage."""
    out: List[LayerPlan] = []
    last_f_here, last_f_any, prev_stage = None, None, -1
    for i, (declared, stage) in enumerate(zip(roles, stage_of)):
        if stage != prev_stage:
            last_f_here, prev_stage = None, stage
        if declared == "F":
            out.append(LayerPlan(i, stage, "F", "F", False, i))
            last_f_here = last_f_any = i
        elif last_f_here is None:  # an S that opens its stage: nothing on this stage to reuse
            where = (
                f"its nearest F (layer {last_f_any}) is on stage {stage_of[last_f_any]}"
                if last_f_any is not None else "no F layer precedes it"
            )
            why = (
                f"declared S but first layer of stage {stage}; {where} and indices do not cross stages, "
                "so it runs its own indexer"
            )
            out.append(LayerPlan(i, stage, "S", "F", True, i, why))
            last_f_here = i  # deliberately not last_f_any: the reason names the declared F the user meant
        else:
            out.append(LayerPlan(i, stage, "S", "S", False, last_f_here))
    return tuple(out)


def build_plan(cfg, nproc=None) -> Plan:
    """Resolve and check `cfg` (a DSAFlowConfig); raises PlanError on any config or plan mistake.
    nproc: the process count the command was asked to launch (`dsaflow train --nproc N`); None = pipeline ranks."""
    check_fields(cfg)
    n = cfg.model.num_layers
    roles, layout_starts = declared_roles(cfg)
    starts = stage_starts(cfg, layout_starts, layer_costs(cfg, roles), promotion_costs(cfg, roles))
    stage_of = stage_of_layers(starts, n)
    pipeline = resolve_pipeline(
        cfg.pipeline, len(starts), mode=cfg.mode, batch_size=cfg.train.batch_size, nproc=nproc
    )
    ranks = stage_ranks(len(starts), pipeline)
    bounds = list(starts[1:]) + [n]
    stages = tuple(StagePlan(s, ranks[s], tuple(range(starts[s], bounds[s]))) for s in range(len(starts)))
    layers = resolve_layers(roles, stage_of)
    blocks = plan_graph_blocks(cfg, stage_of, len(stages))
    estimates = build_estimates(cfg, layers, stages, pipeline)
    return Plan(num_layers=n, stages=stages, layers=layers, graph_blocks=blocks, pipeline=pipeline, estimates=estimates)
