"""The run dir: everything a worker needs, written by the parent before any process starts.

    <run_dir>/config.yaml     resolved config (workers read it without Hydra)
              plan.json       the Plan (workers build their stages from it)
              plan.txt        the plan table, as printed
              metrics.jsonl   one JSON object per logged step (logging rank)
              train.log       plain-text log of the logging rank
              checkpoints/step-000100/   torch.distributed.checkpoint folders (`.metadata` marks a complete one)
              wandb/          the tracker's files (offline runs: `wandb sync <run_dir>/wandb/offline-run-*`)

Default location: runs/<YYYYmmdd-HHMMSS>-<name>. The parent plans first and only then creates the folder (via a
temporary sibling renamed into place), so a planning error leaves nothing on disk.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional, Tuple

from dsaflow.plan.plan import Plan, PlanError

CONFIG, PLAN, PLAN_TXT, METRICS, LOG, CKPT = "config.yaml", "plan.json", "plan.txt", "metrics.jsonl", "train.log", "checkpoints"


def default_run_dir(cfg) -> str:
    name = cfg.track.run_name or f"{cfg.model.name}-{cfg.data.name}"
    return os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CKPT / f"step-{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Optional[Tuple[int, Path]]:
    """(step, path) of the newest complete checkpoint, or None. DCP writes `.metadata` last, after every rank's
    shards, so a folder without it is a checkpoint interrupted mid-write and is skipped."""
    root = Path(run_dir) / CKPT
    best = None
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith("step-") and (d / ".metadata").is_file():
                step = int(d.name.split("-")[1])
                if best is None or step > best[0]:
                    best = (step, d)
    return best


def write_run_dir(cfg, plan: Plan, table: str) -> Path:
    """Create (or, for `train.resume=true`, reuse) the run dir and write config.yaml, plan.json and plan.txt."""
    from dsaflow.config.compose import to_yaml

    run_dir = Path(cfg.run_dir or default_run_dir(cfg))
    files = {CONFIG: to_yaml(cfg), PLAN: plan.to_json(), PLAN_TXT: table + "\n"}
    if run_dir.exists():
        if not (run_dir / PLAN).is_file():
            if any(run_dir.iterdir()):
                raise PlanError(
                    f"run_dir={run_dir} exists and is not a dsaflow run dir (no {PLAN}). Fix: choose another run_dir "
                    "or remove that folder."
                )
        else:
            old = Plan.from_json((run_dir / PLAN).read_text())
            same_layout = [s.layers for s in old.stages] == [s.layers for s in plan.stages]
            if cfg.train.resume and not same_layout:
                raise PlanError(
                    f"train.resume=true but run_dir={run_dir} was trained with stages "
                    f"{[list(s.layers) for s in old.stages]}, and this config plans "
                    f"{[list(s.layers) for s in plan.stages]}: its checkpoints cannot be loaded. Fix: use the run's "
                    f"config.yaml (the same pipeline.*) or start a new run_dir."
                )
            if not cfg.train.resume and latest_checkpoint(run_dir) is not None:
                raise PlanError(
                    f"run_dir={run_dir} already holds checkpoints. Fix: set train.resume=true to continue that run, "
                    "or choose a new run_dir."
                )
        for name, text in files.items():
            _atomic_write(run_dir / name, text)
        return run_dir
    tmp = run_dir.parent / f".{run_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        tmp.rename(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_run_dir(run_dir: str | Path):
    """-> (cfg, plan) from a run dir written by `write_run_dir` (no Hydra)."""
    from dsaflow.config.compose import load_config

    run_dir = Path(run_dir)
    for name in (CONFIG, PLAN):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} is missing: RUN_DIR must be a folder written by `dsaflow train`.")
    return load_config(run_dir / CONFIG), Plan.from_json((run_dir / PLAN).read_text())


def read_metrics(run_dir: str | Path) -> list:
    """Every record of metrics.jsonl (a resumed run may repeat steps; the later record wins in `by_step`)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
