"""Where a command may write what the user asked for: output paths that can never overwrite a run.

An output path (`serve.output_file`, `search.out_dir`) is the user's to choose, but a typo or a tab-completed path
must not replace a run's `metrics.jsonl`, its `config.yaml`, a checkpoint's `manifest.json` or the prompts file
the same command reads. So, before anything starts, `check_output_file` / `check_output_dir`:

  * resolve the path (links followed, as the write would reach them) and refuse it, exit status 2, when it lies in
    a run dir (a folder holding `plan.json`, or `config.yaml` with a run's files) or a checkpoint folder (one
    holding `manifest.json`);
    `check_output_dir(..., in_run_ok=True)` lets a folder of its own sit in a run dir (the default
    `<run dir>/search`), never the run dir itself, its `checkpoints/` or a checkpoint;
  * refuse it when it is one of the command's inputs, or lies inside an input folder;
  * refuse what cannot be written (a folder, a FIFO, a missing or read-only parent folder).

The writes themselves go through `dsaflow.files.atomic_write`: readers see the old file or the whole new one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Dict, Optional

from dsaflow.errors import PlanError
from dsaflow.files import explain_os_error, kind_of

# The files that mark a run dir and a checkpoint folder (dsaflow.rundir.folder and dsaflow.checkpoint.store write them;
# tests/test_outputs.py checks the names agree).
PLAN, CONFIG = "plan.json", "config.yaml"
RUN_FILES = ("metrics.jsonl", "train.log", "run_id", "checkpoints")  # with config.yaml: a run dir missing plan.json
CHECKPOINT_MARKER = "manifest.json"
CHECKPOINTS = "checkpoints"


def _resolve(path) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError):  # a link loop: the write would fail on it too
        return Path(os.path.abspath(Path(path).expanduser()))


def is_run_dir(folder: Path) -> bool:
    """plan.json, or config.yaml next to a run's own files (a config.yaml alone is any project's config)."""
    if os.path.lexists(folder / PLAN):
        return True
    return os.path.lexists(folder / CONFIG) and any(os.path.lexists(folder / f) for f in RUN_FILES)


def is_checkpoint(folder: Path) -> bool:
    return os.path.lexists(folder / CHECKPOINT_MARKER)


def protected_owner(target: Path, in_run_ok: bool = False) -> Optional[str]:
    """'the run dir X' / 'the checkpoint X' when writing `target` (resolved) would touch a run, else None.
    in_run_ok: `target` is a folder of its own, which may lie in a run dir (not be one, nor be in a checkpoint)."""
    for folder in [target, *target.parents]:
        if is_checkpoint(folder):
            return f"the checkpoint folder {folder}"
        if is_run_dir(folder):
            if in_run_ok and folder != target and target.relative_to(folder).parts[0] != CHECKPOINTS:
                continue
            return f"the run dir {folder}"
    return None


def _same_or_inside(target: Path, inputs: Dict[str, Optional[str]]) -> Optional[str]:
    for field, value in inputs.items():
        if not value:
            continue
        src = _resolve(value)
        if target == src or src in target.parents:
            return f"{field}={value}"
        try:
            if os.path.samefile(target, src):  # a hard link to the input
                return f"{field}={value}"
        except OSError:
            pass
    return None


def _refuse_protected(field: str, path, target: Path, inputs, in_run_ok: bool) -> None:
    owner = protected_owner(target, in_run_ok)
    if owner is not None:
        raise PlanError(
            f"{field}={path} resolves to {target}, inside {owner}; an output never replaces a run's or a "
            f"checkpoint's files. Fix: choose a path outside every run dir, e.g. {field}={Path(target.name).stem}"
            f"{Path(target.name).suffix or ''} in the current folder. Nothing was written."
        )
    source = _same_or_inside(target, inputs)
    if source is not None:
        raise PlanError(
            f"{field}={path} is (or lies inside) {source}, an input of this command; writing it would destroy "
            f"what is read. Fix: choose another {field}. Nothing was written."
        )


def check_output_file(field: str, path: Optional[str], inputs: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Raise PlanError (exit 2, nothing written) unless `path` is a file this command may (over)write."""
    if not path:
        return
    target = _resolve(path)
    _refuse_protected(field, path, target, inputs or {}, in_run_ok=False)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise PlanError(f"{field}={path} {explain_os_error(exc)}. Fix: choose another output file.") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise PlanError(
            f"{field}={path} is {kind_of(st.st_mode)}, not a file the output can be written to. Fix: name a file, "
            f"e.g. {field}=completions.jsonl."
        )
    folder = target.parent
    if not folder.is_dir():
        raise PlanError(f"{field}={path}: its folder {folder} does not exist. Fix: create it, or choose another file.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PlanError(f"{field}={path} is not writable by you. Fix: choose a file in a folder you can write.")


def check_output_dir(
    field: str, path, inputs: Optional[Dict[str, Optional[str]]] = None, in_run_ok: bool = False
) -> Path:
    """Raise PlanError unless `path` is a folder this command may create and fill; -> the resolved folder."""
    target = _resolve(path)
    _refuse_protected(field, path, target, inputs or {}, in_run_ok)
    if target.exists() and not target.is_dir():
        raise PlanError(f"{field}={path} exists and is not a folder. Fix: choose another {field}.")
    return target


def path_under(root: str, *names: str) -> str:
    """os.path.join(root, *names), refused (PlanError) unless it resolves to a path inside `root`: every name a
    config turns into a path is checked by the schema, and this holds the join to its folder whatever the names."""
    path = os.path.join(root, *names)
    base = _resolve(root)
    if base not in _resolve(path).parents:
        raise PlanError(
            f"{path} would lie outside {root}/ (a name holds a path separator or '..'). Fix: plain names for "
            "track.run_name, model.name and data.name."
        )
    return path
