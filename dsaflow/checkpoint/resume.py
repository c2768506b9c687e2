"""Whether `train.resume=true` can continue a run dir: the run's config.yaml and plan.json against the config now
(model, data, seed, sequence length, batch size, stages, ranks, layer roles), its metrics readable, and a good
checkpoint older than `train.steps`. The parent checks this before anything is written; every rank then loads the
same newest good checkpoint (dsaflow.checkpoint.training_state.load_checkpoint)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List, Tuple

from dsaflow.checkpoint.store import newest_good_checkpoint
from dsaflow.errors import PlanError
from dsaflow.plan.plan import Plan
from dsaflow.rundir.folder import CONFIG, PLAN, read_metrics, read_plan


def _asdict(x) -> dict:
    return {k: (str(v) if isinstance(v, str) else v) for k, v in dataclasses.asdict(x).items()}


def _diff(section: str, old, new, skip=("name",)) -> List[str]:
    a, b = _asdict(old), _asdict(new)
    return [f"{section}.{k}: {a.get(k)!r} in the run vs {b[k]!r} now" for k in b if k not in skip and a.get(k) != b[k]]


def check_resume(cfg, plan: Plan, report=None) -> Tuple[int, Path]:
    """Everything that decides whether `train.resume=true` can continue cfg.run_dir, checked in the parent before
    anything is written. Returns the newest good checkpoint (step, folder). Raises PlanError."""
    from dsaflow.config.compose import load_config

    run_dir = Path(cfg.run_dir)
    if not os.path.lexists(run_dir / CONFIG) or not os.path.lexists(run_dir / PLAN):
        raise PlanError(
            f"train.resume=true but run_dir={run_dir} is not a dsaflow run dir (no {CONFIG} and {PLAN}). "
            "Fix: point run_dir at runs/<name> of the run to continue."
        )
    old_cfg = load_config(run_dir / CONFIG)
    old_plan = read_plan(run_dir)
    read_metrics(run_dir, strict=True)
    diffs = _diff("model", old_cfg.model, cfg.model) + _diff("data", old_cfg.data, cfg.data)
    for k in ("seed", "seq_len", "batch_size"):
        if getattr(old_cfg.train, k) != getattr(cfg.train, k):
            diffs.append(f"train.{k}: {getattr(old_cfg.train, k)!r} in the run vs {getattr(cfg.train, k)!r} now")
    if [s.layers for s in old_plan.stages] != [s.layers for s in plan.stages]:
        diffs.append(
            f"stages {[list(s.layers) for s in old_plan.stages]} in the run vs "
            f"{[list(s.layers) for s in plan.stages]} now"
        )
    if [s.rank for s in old_plan.stages] != [s.rank for s in plan.stages]:
        diffs.append(
            f"stage ranks {[s.rank for s in old_plan.stages]} in the run vs {[s.rank for s in plan.stages]} now"
        )
    old_roles = "".join(l.role for l in old_plan.layers)
    new_roles = "".join(l.role for l in plan.layers)
    if old_roles != new_roles:
        diffs.append(f"layer roles {old_roles} in the run vs {new_roles} now (S layers carry no indexer weights)")
    if diffs:
        raise PlanError(
            f"train.resume=true but run_dir={run_dir} was trained with another setup, so its checkpoints cannot be "
            f"loaded: {'; '.join(diffs[:4])}. Fix: resume with the run's own settings (see {run_dir / CONFIG}; "
            "pipeline.*, layout, index.*, model.*, data.*; parallel.dp may change, since a checkpoint holds whole "
            "stages), or start a new run_dir. Nothing was written."
        )
    found = newest_good_checkpoint(run_dir, report)
    if found is None:
        raise PlanError(
            f"train.resume=true but run_dir={run_dir} holds no complete checkpoint (none, or every one failed its "
            "manifest check). Fix: point run_dir at a run that saved one (train.ckpt_every>0), or drop train.resume."
        )
    if found[0] >= cfg.train.steps:
        raise PlanError(
            f"train.resume=true but run_dir={run_dir} already finished: its newest checkpoint is step {found[0]} and "
            f"train.steps={cfg.train.steps}. Fix: raise train.steps to continue training it."
        )
    return found
