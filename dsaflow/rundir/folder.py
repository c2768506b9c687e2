"""The run dir: everything a worker needs, written by the parent before any process starts.

    <run_dir>/config.yaml     resolved config (workers read it without Hydra)
              plan.json       the Plan (workers build their stages from it)
              plan.txt        the plan table, as printed
              metrics.jsonl   one JSON object per logged step (logging rank)
              train.log       plain-text log of the logging rank
              hf_files/       model=hf: config.json and the tokenizer files of model.hf_path (hf_run_copy.py)
              checkpoints/step-000100/   see dsaflow.checkpoint.store (manifest, weights-only safetensors)
              wandb/          the tracker's files (offline runs: `wandb sync <run_dir>/wandb/offline-run-*`)
              tmp/            temporary files of torchrun and the workers (removed when the launch ends)

Default location: runs/<YYYYmmdd-HHMMSS>-<name> for training, runs/generate/<YYYYmmdd-HHMMSS>-<name> for
`dsaflow generate`. A run dir is created atomically and uniquely: its files are written into a temporary sibling
that is renamed into place, and a name that another launch took meanwhile gets a `-2`, `-3`, ... suffix, so two
launches never share one. An explicit `run_dir` that already holds a run is refused unless `train.resume=true`,
and resuming is checked against the run (model, layout, roles, stages, ranks, data) before anything is written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsaflow.errors import PlanError
from dsaflow.files import UnsafeFile, atomic_write, explain_os_error, parse_json, read_text
from dsaflow.outputs import path_under
from dsaflow.plan.plan import Plan

__all__ = [
    "CKPT",
    "checkpoint_dir",
    "list_checkpoints",
    "read_run_dir",
    "read_plan",
    "read_metrics",
    "write_run_dir",
    "check_run_dir",
]

CONFIG, PLAN, PLAN_TXT, METRICS, LOG, TMP = "config.yaml", "plan.json", "plan.txt", "metrics.jsonl", "train.log", "tmp"
CKPT, MANIFEST = "checkpoints", "manifest.json"  # checkpoints/step-NNNNNN/, each holding its manifest.json
_STEP_DIR = re.compile(r"^step-(\d{6,9})$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CKPT / f"step-{step:06d}"


def list_checkpoints(run_dir: str | Path) -> List[Tuple[int, Path]]:
    """Complete-looking checkpoint folders (step-NNNNNN, real folders, not links), newest first."""
    root = Path(run_dir) / CKPT
    out = []
    try:
        entries = list(os.scandir(root)) if root.is_dir() and not root.is_symlink() else []
    except OSError:
        entries = []
    for e in entries:
        m = _STEP_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            out.append((int(m.group(1)), Path(e.path)))
    return sorted(out, reverse=True)


def default_run_dir(cfg, job: str = "train") -> str:
    name = cfg.track.run_name or f"{cfg.model.name}-{cfg.data.name}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if job == "generate":
        return path_under("runs", "generate", f"{stamp}-{cfg.model.name}")
    return path_under("runs", f"{stamp}-{name}")


def is_run_dir(path: Path) -> bool:
    return os.path.lexists(path / PLAN) or os.path.lexists(path / CONFIG)


def _enclosing_run(p: Path) -> Optional[Path]:
    """The run dir or checkpoint folder that `p` would lie inside, if any (a run dir never nests in either)."""
    try:
        resolved = p.resolve()
    except (OSError, RuntimeError):
        return None
    for parent in resolved.parents:
        if is_run_dir(parent) or os.path.lexists(parent / MANIFEST):
            return parent
    return None


def read_plan(run_dir: Path) -> Plan:
    """plan.json of a run dir, read as a regular file with bounds; PlanError naming the file when it is corrupt."""
    path = Path(run_dir) / PLAN
    try:
        data = parse_json(read_text(path, inside=run_dir), str(path), max_depth=16)
        return Plan.from_json(json.dumps(data))
    except UnsafeFile as exc:
        raise PlanError(f"{exc}. Fix: point at a run dir written by `dsaflow train`, or start a new run_dir.") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise PlanError(
            f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:120]}): corrupted or edited. Fix: "
            "start a new run_dir (or restore the file)."
        ) from None


def check_run_dir(cfg, plan: Plan, job: str = "train") -> None:
    """The parent's checks of an explicit `run_dir` (before anything is written). Raises PlanError. A resumed run is
    checked further by dsaflow.checkpoint.resume.check_resume."""
    resume = job == "train" and cfg.train.resume
    if not cfg.run_dir:
        if resume:
            raise PlanError("train.resume=true needs run_dir=<the run to continue>. Fix: add run_dir=runs/<name>.")
        return
    p = Path(cfg.run_dir)
    try:
        os.lstat(p)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise PlanError(
                f"run_dir={str(p)[:120]}... ({len(str(p))} characters) {explain_os_error(exc)}. Fix: "
                "choose a shorter run_dir (each folder name at most 255 bytes)."
            ) from None
    if p.exists() and not p.is_dir():
        raise PlanError(f"run_dir={p} exists and is not a folder. Fix: choose another run_dir.")
    outer = _enclosing_run(p)
    if outer is not None:
        raise PlanError(
            f"run_dir={p} lies inside {outer}, which is a run dir or a checkpoint folder; a run there "
            "would mix its files with that run's (and its checkpoints could be pruned as that run's). "
            "Fix: choose a run_dir outside every run dir, e.g. runs/<new name>."
        )
    if resume:
        return  # the run itself is checked by dsaflow.checkpoint.resume.check_resume
    if p.is_dir() and any(p.iterdir()):
        what = "holds another run" if is_run_dir(p) else "is not empty"
        raise PlanError(
            f"run_dir={p} {what}; a new run never writes into it. Fix: choose a new run_dir (or leave it unset for "
            f"runs/<time>-<name>){', or set train.resume=true to continue it' if is_run_dir(p) else ''}."
        )
    parent = p.parent if not p.exists() else p
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PlanError(f"run_dir={p}: {parent} is a file, not a folder. Fix: choose another run_dir.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"run_dir={p}: {parent} is not writable. Fix: choose a run_dir in a folder you can write.")


def write_run_dir(cfg, plan: Plan, table: str, job: str = "train", kept: Optional[Dict[str, bytes]] = None) -> Path:
    """Create the run dir atomically (or, for `train.resume=true`, rewrite its config in place) and write
    config.yaml, plan.json and plan.txt. kept: {relative path: bytes} of inputs the new run keeps a copy of (the
    Hugging Face files of dsaflow.checkpoint.hf_run_copy), written inside the atomic creation; a resumed run keeps
    the copy it has. Call check_run_dir first."""
    from dsaflow.config.compose import to_yaml

    files = {CONFIG: to_yaml(cfg), PLAN: plan.to_json(), PLAN_TXT: table + "\n"}
    if cfg.run_dir and job == "train" and cfg.train.resume:
        run_dir = Path(cfg.run_dir)
        try:
            for name, text in files.items():
                atomic_write(run_dir / name, text)
        except OSError as exc:
            raise PlanError(
                f"run_dir={run_dir}: cannot rewrite its files ({explain_os_error(exc)}). Fix: free space "
                "or fix the folder's permissions."
            ) from None
        return run_dir
    base = Path(cfg.run_dir or default_run_dir(cfg, job))
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(
            f"run_dir={base}: cannot create {base.parent} ({exc.strerror}). Fix: choose another run_dir."
        ) from None
    tmp = base.parent / f".{base.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        for name, text in files.items():
            atomic_write(tmp / name, text)
        for name, data in (kept or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(tmp / name, data)
        for attempt in range(1, 1000):
            target = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
            try:
                if target.is_dir() and not any(target.iterdir()) and cfg.run_dir:
                    target.rmdir()  # an explicit, empty run_dir: take it
                os.rename(tmp, target)  # atomic; fails when another launch holds the name
                return target
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                if cfg.run_dir:
                    raise PlanError(
                        f"run_dir={base} was created by another launch meanwhile. Fix: choose another run_dir."
                    ) from None
        raise PlanError(f"could not find a free run dir name next to {base}. Fix: set run_dir explicitly.")
    except OSError as exc:
        raise PlanError(
            f"run_dir={base}: cannot write it ({exc.strerror or exc}). Fix: choose a run_dir in a folder you can write."
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_run_dir(run_dir: str | Path):
    """-> (cfg, plan) from a run dir written by `write_run_dir` (no Hydra). Both files are read as regular files
    with bounds, and plan.json must be the plan of config.yaml (a hand-edited plan with impossible values is refused
    here, before any process group forms)."""
    from dsaflow.config.compose import load_config
    from dsaflow.plan import build_plan

    run_dir = Path(run_dir)
    for name in (CONFIG, PLAN):
        if not os.path.lexists(run_dir / name):
            raise PlanError(f"{run_dir / name} is missing: RUN_DIR must be a folder written by `dsaflow train`.")
    cfg, plan = load_config(run_dir / CONFIG), read_plan(run_dir)
    try:
        expected = build_plan(cfg)
    except PlanError as exc:
        raise PlanError(f"{run_dir / CONFIG} does not plan: {exc}") from None
    if expected.to_json() != plan.to_json():
        raise PlanError(
            f"{run_dir / PLAN} is not the plan of {run_dir / CONFIG} (edited by hand, or written by "
            "another dsaflow version), so its stages and ranks cannot be trusted. Fix: write the run dir "
            "again with `python -m dsaflow.launch.launch prepare ...` (or `dsaflow train`)."
        )
    return cfg, plan


def read_metrics(run_dir: str | Path, strict: bool = False) -> list:
    """Every record of metrics.jsonl (a resumed run may repeat steps; the later record wins in `by_step`). A torn
    last line (a kill mid-write) is dropped. Other unreadable lines are skipped, or with strict=True refused with a
    PlanError naming the line."""
    path = Path(run_dir) / METRICS
    if not os.path.lexists(path):
        return []
    try:
        text = read_text(path, inside=run_dir, max_bytes=1 << 30)
    except UnsafeFile as exc:
        if strict:
            raise PlanError(f"{exc}. Fix: remove it (or move it away) to continue the run.") from None
        return []
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = parse_json(line, f"{path} line {n}", max_depth=4)
            if not isinstance(rec, dict) or type(rec.get("step")) is not int:
                raise UnsafeFile(f"{path} line {n} is not a record with an integer step")
        except UnsafeFile as exc:
            if n == len(lines) or not strict:  # the last line has no newline: a torn write
                continue
            raise PlanError(
                f"{exc}: metrics.jsonl is corrupted. Fix: delete that line (or the file) to resume; "
                "the checkpoints are unaffected."
            ) from None
        out.append(rec)
    return out
