"""Graph-block rules: every requested CUDA-graph block must exist on some stage.

decode / prefill / mixed: whole-stage blocks, only when mode=serve, captured on every stage (mixed: the token-major
                 mixed passes of serve.max_pass_tokens, padded to token-count classes).
head:            final norm + LM head, only on the last stage.
layers:          a span [first, last] of layers that exists and sits inside one stage.
Shape classes are the padded sizes captured per block: strictly increasing, positive, <= graphs.max_shape.

Every kind the planner accepts for a mode is captured in that mode. Serving captures whole-stage decode / prefill
graphs, which already contain the head and every layer of the stage, and training captures none; so a `head` or
`layers` block is checked for existence (a typo is reported as such) and then refused before anything launches.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from dsaflow.errors import PlanError
from dsaflow.plan.plan import GraphBlockPlan


def _check_shapes(block, max_shape: int) -> Tuple[int, ...]:
    sc = list(block.shape_classes)
    field = f"graphs.blocks[{block.name}].shape_classes"
    if not sc:
        raise PlanError(f"{field}=[] is empty. Fix: list at least one size to capture, e.g. [1, 2, 4, 8].")
    if any(s <= 0 for s in sc):
        raise PlanError(f"{field}={sc}: sizes must be positive. Fix: drop the zero/negative entries.")
    if any(b <= a for a, b in zip(sc, sc[1:])):
        raise PlanError(
            f"{field}={sc}: shape classes must be sorted strictly increasing (inputs are padded up to the next "
            f"class). Fix: {field}={sorted(set(sc))}."
        )
    if sc[-1] > max_shape:
        raise PlanError(
            f"{field}={sc}: {sc[-1]} exceeds graphs.max_shape={max_shape}. Fix: drop the larger classes or raise "
            "graphs.max_shape."
        )
    return tuple(sc)


def plan_graph_blocks(cfg, stage_of: Sequence[int], num_stages: int) -> Tuple[GraphBlockPlan, ...]:
    g = cfg.graphs
    if g.transfers and cfg.mode != "serve":
        raise PlanError(
            f"graphs.transfers=true replays serving transfers from CUDA graphs, but mode={cfg.mode}. Fix: "
            "graphs.transfers=false, or serve (mode=serve, `dsaflow generate`)."
        )
    if not g.blocks:
        return ()
    names = [b.name for b in g.blocks]
    if not g.enabled:
        raise PlanError(
            f"graphs.blocks requests {names} but graphs.enabled=false. Fix: set graphs.enabled=true to capture "
            "them, or graphs=off to drop the blocks."
        )
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise PlanError(f"graphs.blocks has duplicate name(s) {dup}. Fix: give every block its own name.")
    n = len(stage_of)
    out: List[GraphBlockPlan] = []
    for b in g.blocks:
        field = f"graphs.blocks[{b.name}]"
        shapes = _check_shapes(b, g.max_shape)
        if b.kind != "layers" and b.layers is not None:
            raise PlanError(
                f"{field}.layers={list(b.layers)} is only meaningful for kind=layers (this block is kind={b.kind}). "
                "Fix: drop `layers`, or set kind=layers."
            )
        if b.kind in ("decode", "prefill", "mixed"):
            if cfg.mode != "serve":
                raise PlanError(
                    f"{field}: kind={b.kind} exists only when serving, but mode={cfg.mode}. Fix: set mode=serve "
                    "(or run `dsaflow generate`), or use graphs=off for training."
                )
            out.append(GraphBlockPlan(b.name, str(b.kind), tuple(range(num_stages)), (), shapes))
        elif b.kind == "head":
            _refuse_uncaptured(field, b.kind, cfg.mode)
        else:
            span = list(b.layers) if b.layers is not None else []
            if len(span) != 2:
                raise PlanError(
                    f"{field}.layers={span}: kind=layers needs [first, last] (inclusive). Fix: e.g. layers=[0, 3]."
                )
            first, lst = span
            if first > lst:
                raise PlanError(f"{field}.layers={span}: first > last. Fix: {field}.layers=[{lst}, {first}].")
            missing = [i for i in (first, lst) if i < 0 or i >= n]
            if missing:
                raise PlanError(
                    f"{field}.layers={span}: layer {missing[0]} does not exist (model.num_layers={n}, layers "
                    f"0..{n - 1}). Fix: choose a span inside 0..{n - 1}."
                )
            if stage_of[first] != stage_of[lst]:
                cut = next(i for i in range(first, lst + 1) if stage_of[i] != stage_of[first])
                raise PlanError(
                    f"{field}.layers={span} spans stage {stage_of[first]} and stage {stage_of[lst]}; a graph is "
                    f"captured on one device, so a block must sit inside one stage. Fix: split it where stage "
                    f"{stage_of[cut]} starts, into layers=[{first}, {cut - 1}] and layers=[{cut}, {lst}]."
                )
            _refuse_uncaptured(field, b.kind, cfg.mode)
    return tuple(out)


def _refuse_uncaptured(field: str, kind: str, mode: str) -> None:
    what = (
        "serving captures whole-stage decode / prefill graphs, which already contain the head and every layer"
        if mode == "serve"
        else "training captures no CUDA graphs"
    )
    raise PlanError(
        f"{field}: kind={kind} exists in the plan but is never captured ({what}), so it would be ignored. "
        "Fix: drop the block; to serve with graphs use graphs=decode or graphs=decode_prefill with mode=serve."
    )
