"""Declared roles and stage boundaries from the config knobs, with every conflict reported as an error.

Roles come from exactly one of `layout`, `index.pattern`, `index.freq` (+ `index.offset`), or none (all F).
Stage starts come from exactly one of: `|` in `layout`, `pipeline.boundaries`, or `pipeline.stages` cut by
`pipeline.balance` (cost: minimise the most expensive stage under the per-layer cost estimate; layers: equal counts).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from dsaflow.errors import PlanError
from dsaflow.plan.layout import freq_roles, parse_layout, tile_pattern


def declared_roles(cfg) -> Tuple[Tuple[str, ...], Optional[Tuple[int, ...]]]:
    """(roles, stage starts written in the layout or None)."""
    n, idx = cfg.model.num_layers, cfg.index
    knobs = [k for k, v in (("layout", cfg.layout), ("index.pattern", idx.pattern), ("index.freq", idx.freq)) if v is not None]
    if len(knobs) > 1:
        raise PlanError(
            f"conflicting role knobs: {' and '.join(knobs)} are both set (layout={cfg.layout!r}, "
            f"index.pattern={idx.pattern!r}, index.freq={idx.freq!r}). Fix: keep one; the layout string alone can "
            "carry roles and stage boundaries (e.g. index=all_full layout='(FSSS)*2|(FSSS)*2')."
        )
    if idx.offset != 0 and idx.freq is None:
        raise PlanError(
            f"index.offset={idx.offset} is set but index.freq is not; offset only applies to the freq rule. "
            "Fix: set index.freq too, or drop index.offset."
        )
    if cfg.layout is not None:
        parsed = parse_layout(cfg.layout, "layout")
        if len(parsed.roles) != n:
            raise PlanError(
                f"layout={cfg.layout!r} describes {len(parsed.roles)} layers but model.num_layers={n} "
                f"(model={cfg.model.name}). Fix: write exactly {n} F/S letters (repeats help: '(FSSS)*{max(1, n // 4)}'), "
                "or choose the model whose depth matches."
            )
        return parsed.roles, (parsed.stage_starts if parsed.has_boundaries else None)
    if idx.pattern is not None:
        return tile_pattern(idx.pattern, n), None
    if idx.freq is not None:
        return freq_roles(idx.freq, idx.offset, n), None
    return ("F",) * n, None


def _check_starts(starts: Sequence[int], n: int, field: str, value) -> Tuple[int, ...]:
    for a, b in zip(starts, starts[1:]):
        if b <= a:
            raise PlanError(
                f"{field}={value}: boundaries must be strictly increasing ({a} then {b}); equal or decreasing values "
                "make an empty stage. Fix: list the first layer of each stage in increasing order, e.g. [0, 4]."
            )
    bad = [b for b in starts if b < 0 or b >= n]
    if bad:
        raise PlanError(
            f"{field}={value}: boundary {bad[0]} is out of range for model.num_layers={n} (a stage must start at a "
            f"layer 0..{n - 1}). Fix: use first-layer indices between 1 and {n - 1}."
        )
    return tuple(starts)


def _balanced_starts(costs: Sequence[float], k: int, opening_extra: Sequence[float]) -> Tuple[int, ...]:
    """Contiguous split of `costs` into k non-empty parts minimising the largest part (exact DP, O(k n^2)).

    A part that starts at layer s also pays `opening_extra[s]`: an S layer that opens a stage is promoted and runs
    the indexer, so the split sees what a promotion costs and prefers cutting just before an F layer on a tie."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: smallest max-part cost splitting the first i layers into j parts; cut[j][i]: start of part j.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s] + opening_extra[s])
                if v < best[j][i] - 1e-9:  # ties keep the earliest cut: deterministic splits
                    best[j][i], cut[j][i] = v, s
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


def _even_starts(n: int, k: int) -> Tuple[int, ...]:
    """Equal layer counts; the first n % k stages get one extra layer."""
    base, extra = divmod(n, k)
    starts, pos = [], 0
    for s in range(k):
        starts.append(pos)
        pos += base + (1 if s < extra else 0)
    return tuple(starts)


def stage_starts(
    cfg, layout_starts: Optional[Tuple[int, ...]], layer_costs: Sequence[float], opening_extra: Sequence[float]
) -> Tuple[int, ...]:
    """First layer of every stage. `layer_costs[i]` is the cost of layer i (head folded into the last layer);
    `opening_extra[i]` is what layer i adds when it opens a stage (its promotion to F; 0 for F layers)."""
    n, pipe = cfg.model.num_layers, cfg.pipeline
    if layout_starts is not None and pipe.boundaries is not None:
        raise PlanError(
            f"conflicting stage knobs: layout={cfg.layout!r} has '|' boundaries and pipeline.boundaries="
            f"{list(pipe.boundaries)} is set. Fix: keep one (drop the '|' from the layout, or pipeline.boundaries=null)."
        )
    if layout_starts is not None:
        if pipe.stages not in (1, len(layout_starts)):
            raise PlanError(
                f"conflicting stage knobs: layout={cfg.layout!r} has {len(layout_starts)} stages but pipeline.stages="
                f"{pipe.stages} (pipeline={pipe.name}). Fix: pipeline.stages={len(layout_starts)} or remove the '|'."
            )
        return layout_starts
    if pipe.boundaries is not None:
        given = list(pipe.boundaries)
        if not given:
            raise PlanError("pipeline.boundaries=[] is empty. Fix: list the first layer of each stage, or set it to null.")
        starts = given if given[0] == 0 else [0] + given
        _check_starts(starts, n, "pipeline.boundaries", given)
        if pipe.stages not in (1, len(starts)):
            raise PlanError(
                f"conflicting stage knobs: pipeline.boundaries={given} makes {len(starts)} stages but "
                f"pipeline.stages={pipe.stages}. Fix: pipeline.stages={len(starts)}, or drop the boundaries."
            )
        return tuple(starts)
    k = pipe.stages
    if k > n:
        raise PlanError(
            f"pipeline.stages={k} is more than model.num_layers={n}: a stage needs at least one layer. Fix: use at "
            f"most {n} stages (or a deeper model)."
        )
    return _balanced_starts(layer_costs, k, opening_extra) if pipe.balance == "cost" else _even_starts(n, k)


def stage_of_layers(starts: Sequence[int], n: int) -> List[int]:
    stage, out = 0, []
    for i in range(n):
        while stage + 1 < len(starts) and starts[stage + 1] <= i:
            stage += 1
        out.append(stage)
    return out
