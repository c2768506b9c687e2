"""Declared roles and stage boundaries from the config knobs, with every conflict reported as an error.

Roles come from exactly one of `layout`, `index.pattern`, `index.freq` (+ `index.offset`), or none (all F).
Stage starts come from exactly one of: `|` in `layout`, `pipeline.boundaries`, or `pipeline.stages` cut by
`pipeline.balance` (cost: minimise the most expensive stage under the per-layer cost estimate; layers: equal counts).
Under index.promote=false without cross-stage indices every stage starts on F (`f_aligned`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from dsaflow.errors import PlanError
from dsaflow.plan.layout import format_layout, freq_roles, parse_layout, tile_pattern


def declared_roles(cfg) -> Tuple[Tuple[str, ...], Optional[Tuple[int, ...]]]:
    """(roles, stage starts written in the layout or None)."""
    n, idx = cfg.model.num_layers, cfg.index
    knobs = [
        k
        for k, v in (("layout", cfg.layout), ("index.pattern", idx.pattern), ("index.freq", idx.freq))
        if v is not None
    ]
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


def _balanced_starts(
    costs: Sequence[float], k: int, opening_extra: Sequence[float], allowed: Optional[Sequence[bool]] = None
) -> Tuple[int, ...]:
    """Contiguous split of `costs` into k non-empty parts minimising the largest part (exact DP, O(k n^2)).

    A part that starts at layer s also pays `opening_extra[s]`: an S layer that opens a stage is promoted and runs
    the indexer, so the split sees what a promotion costs and prefers cutting just before an F layer on a tie.
    allowed[s] False: no part after the first may start at layer s (F-aligned splits); the caller checks that k
    parts are possible."""
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
                if j > 1 and allowed is not None and not allowed[s]:
                    continue
                v = max(best[j - 1][s], prefix[i] - prefix[s] + opening_extra[s])
                if v < best[j][i] - 1e-9:  # ties keep the earliest cut: deterministic splits
                    best[j][i], cut[j][i] = v, s
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return tuple(reversed(starts))


def cost_balance(costs: Sequence[float], starts: Sequence[int]) -> float:
    """max / mean of the stages' summed `costs` for stages starting at `starts` (1.0 = perfectly even)."""
    bounds = list(starts[1:]) + [len(costs)]
    parts = [sum(costs[a:b]) for a, b in zip(starts, bounds)]
    mean = sum(parts) / len(parts)
    return max(parts) / mean if mean > 0 else 1.0


def f_aligned_starts(roles: Sequence[str], costs: Sequence[float], k: int, balance: str) -> Tuple[int, ...]:
    """`pipeline.stages=k` when stages must start on F (index.promote=false without cross-stage indices): the
    balanced split over the F layers only (cost: the cost DP; layers: the same DP over unit costs)."""
    f_layers = [i for i, r in enumerate(roles) if r == "F" and i > 0]
    if len(f_layers) < k - 1:
        raise PlanError(
            f"pipeline.stages={k} with index.promote=false needs {k - 1} stage boundaries on F layers, but only "
            f"{len(f_layers)} layers after layer 0 are F ({f_layers[:12]}). Fix: pipeline.stages={len(f_layers) + 1} "
            f"or fewer, or pipeline.cross_stage_indices=true (a stage may then start on S and read the indices of "
            f"the previous stage)."
        )
    allowed = [r == "F" for r in roles]
    unit = [1.0] * len(roles) if balance == "layers" else costs
    return _balanced_starts(unit, k, [0.0] * len(roles), allowed)


def unconstrained_starts(costs: Sequence[float], k: int) -> Tuple[int, ...]:
    """The cost-balanced split with boundaries anywhere and no promotion cost (what cross-stage indices allow)."""
    return _balanced_starts(costs, k, [0.0] * len(costs))


def refuse_s_starts(roles: Sequence[str], starts: Sequence[int], costs: Sequence[float], field: str, value) -> None:
    """Explicit boundaries under index.promote=false without cross-stage indices: a stage that starts on S has no
    indices to read and no indexer to run. Raises PlanError naming the nearest F-aligned boundaries, each with the
    stage balance (max / mean stage cost) it gives with the other boundaries unchanged, and the most even
    F-aligned split into the same number of stages."""
    bad = [j for j, b in enumerate(starts) if j > 0 and roles[b] == "S"]
    if not bad:
        return
    n = len(roles)
    options = []
    for j in bad:
        lo_limit, hi_limit = starts[j - 1], (starts[j + 1] if j + 1 < len(starts) else n)
        below = [i for i in range(starts[j] - 1, lo_limit, -1) if roles[i] == "F"][:1]
        above = [i for i in range(starts[j] + 1, hi_limit) if roles[i] == "F"][:1]
        moves = []
        for c in below + above:
            trial = list(starts)
            trial[j] = c
            moves.append(f"{c} (balance {cost_balance(costs, trial):.2f})")
        text = " or ".join(moves) if moves else f"no F layer between layers {lo_limit} and {hi_limit}: drop it"
        options.append(f"layer {starts[j]} (stage {j}) -> {text}")
    # the best split into as many stages as possible (up to the requested count) whose stages all start on F
    k = min(len(starts), 1 + sum(1 for i in range(1, n) if roles[i] == "F"))
    best = f_aligned_starts(roles, costs, k, "cost") if k > 1 else (0,)
    fewer = "" if k == len(starts) else f" ({k} stages: only {k - 1} layers after layer 0 are F)"
    suggestion = (
        f"{field}={_render_starts(field, roles, best)}{fewer}, the most even F-aligned split (balance "
        f"{cost_balance(costs, best):.2f})"
        if k > 1
        else "a single stage (no layer after layer 0 is F)"
    )
    where = ", ".join(f"stage {j} at layer {starts[j]}" for j in bad)
    raise PlanError(
        f"{field}={value}: {where} start{'s' if len(bad) == 1 else ''} on an S layer, and index.promote=false says "
        f"S layers have no indexer weights (the model was trained with index sharing), so such a stage could neither "
        f"run its own indexer nor read indices that never cross a stage. Nearest boundaries that start on F: "
        f"{'; '.join(options)}. Fix: {suggestion}, or pipeline.cross_stage_indices=true to send the top-k indices "
        f"across each boundary that starts on S (the plan table lists the bytes per boundary)."
    )


def _render_starts(field: str, roles: Sequence[str], starts: Sequence[int]):
    if field == "layout":
        return repr(format_layout(tuple(roles), tuple(starts)))
    return list(starts[1:]) if starts[0] == 0 else list(starts)


def _even_starts(n: int, k: int) -> Tuple[int, ...]:
    """Equal layer counts; the first n % k stages get one extra layer."""
    base, extra = divmod(n, k)
    starts, pos = [], 0
    for s in range(k):
        starts.append(pos)
        pos += base + (1 if s < extra else 0)
    return tuple(starts)


def stage_starts(
    cfg,
    layout_starts: Optional[Tuple[int, ...]],
    layer_costs: Sequence[float],
    opening_extra: Sequence[float],
    roles: Sequence[str] = (),
) -> Tuple[int, ...]:
    """First layer of every stage. `layer_costs[i]` is the cost of layer i (head folded into the last layer);
    `opening_extra[i]` is what layer i adds when it opens a stage (its promotion to F; 0 for F layers).
    With index.promote=false and no cross-stage indices (`f_aligned(cfg)`), every stage must start on F:
    explicit boundaries that start on S are refused with the alternatives, automatic splits cut only before F."""
    n, pipe = cfg.model.num_layers, cfg.pipeline
    aligned = f_aligned(cfg)
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
        if aligned:
            refuse_s_starts(roles, layout_starts, layer_costs, "layout", repr(cfg.layout))
        return layout_starts
    if pipe.boundaries is not None:
        given = list(pipe.boundaries)
        if not given:
            raise PlanError(
                "pipeline.boundaries=[] is empty. Fix: list the first layer of each stage, or set it to null."
            )
        starts = given if given[0] == 0 else [0] + given
        _check_starts(starts, n, "pipeline.boundaries", given)
        if pipe.stages not in (1, len(starts)):
            raise PlanError(
                f"conflicting stage knobs: pipeline.boundaries={given} makes {len(starts)} stages but "
                f"pipeline.stages={pipe.stages}. Fix: pipeline.stages={len(starts)}, or drop the boundaries."
            )
        if aligned:
            refuse_s_starts(roles, starts, layer_costs, "pipeline.boundaries", given)
        return tuple(starts)
    k = pipe.stages
    if k > n:
        raise PlanError(
            f"pipeline.stages={k} is more than model.num_layers={n}: a stage needs at least one layer. Fix: use at "
            f"most {n} stages (or a deeper model)."
        )
    if aligned and k > 1:
        return f_aligned_starts(roles, layer_costs, k, str(pipe.balance))
    return _balanced_starts(layer_costs, k, opening_extra) if pipe.balance == "cost" else _even_starts(n, k)


def f_aligned(cfg) -> bool:
    """True when every stage must start on F: S layers carry no indexer (index.promote=false) and no indices cross
    a stage (pipeline.cross_stage_indices=false)."""
    return not cfg.index.promote and not cfg.pipeline.cross_stage_indices


def stage_of_layers(starts: Sequence[int], n: int) -> List[int]:
    stage, out = 0, []
    for i in range(n):
        while stage + 1 < len(starts) and starts[stage + 1] <= i:
            stage += 1
        out.append(stage)
    return out
