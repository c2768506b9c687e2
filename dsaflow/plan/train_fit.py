"""Whether a training plan fits its device: `dsaflow plan` (train mode) against plan.device_memory_gib, exit 2 naming
the largest memory term of the rank furthest over and what shrinks it. The pre-launch check of `dsaflow train` does
the same against the real device (dsaflow.launch.resources)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from dsaflow.errors import ResourceError
from dsaflow.plan.memory import TRANSIENT, largest_term_fix
from dsaflow.plan.serve_memory import USABLE_FRACTION, gib_text, largest_term, plan_device_bytes


def rank_train_terms(plan) -> List[Tuple[int, List[int], Dict[str, float]]]:
    """(rank, its stages, {term: bytes}) for every pipeline rank: the terms of the stages it holds (the plan's
    `train_memory_bytes`) summed, but the transient, which is one backward's at a time, taken as the largest."""
    out = []
    for rank in sorted({s.rank for s in plan.stages}):
        stages = [s.index for s in plan.stages if s.rank == rank]
        terms: Dict[str, float] = {}
        for i in stages:
            for name, b in plan.estimates["stages"][i]["train_memory_bytes"].items():
                terms[name] = max(terms.get(name, 0), b) if name == TRANSIENT else terms.get(name, 0) + b
        out.append((rank, stages, terms))
    return out


def check_train_fit(cfg, plan) -> None:
    """Raise ResourceError when a rank's training peak exceeds the usable share of plan.device_memory_gib."""
    usable = USABLE_FRACTION * plan_device_bytes(cfg)
    ranks = rank_train_terms(plan)
    over = [(r, st, terms) for r, st, terms in ranks if sum(terms.values()) > usable]
    if not over:
        return
    rank, stages, terms = max(over, key=lambda o: sum(o[2].values()))
    name, biggest = largest_term(terms)
    where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages}"
    others = f" ({len(over)} of {len(ranks)} ranks are over)" if len(over) > 1 else ""
    listed = ", ".join(f"{n} {gib_text(b)}" for n, b in terms.items())
    raise ResourceError(
        f"training {cfg.model.name} at train.seq_len={cfg.train.seq_len}: rank {rank} ({where}) needs "
        f"{gib_text(sum(terms.values()))} at its peak, more than the {gib_text(usable)} usable of "
        f"plan.device_memory_gib={cfg.plan.device_memory_gib:.4g} ({USABLE_FRACTION:.0%}){others}: {listed}. The "
        f"largest term is {name} ({gib_text(biggest)}). Fix: {largest_term_fix(name)}; or plan for a device with "
        "more memory (plan.device_memory_gib)."
    )
