"""Which layers of a checkpoint carry indexer weights, and what that means for the plan that serves or resumes it.

A model trained with index sharing (`index=every4`, GLM-5.2's IndexShare) ships no indexer on its S layers. The
planner's default answer to a stage that opens on S, promoting that layer to F, would then need weights that do not
exist. `plan_for_checkpoint` reads the checkpoint's weight headers (no tensor data) before planning:
- a layer the config declares F whose indexer is missing is an error (exit 2) naming the layers;
- when the plan would promote a layer whose indexer is missing, the checkpoint implies `index.promote=false`: the
  config is changed (the run dir records it), a message says so, and the plan is built again, so stages start on F
  or, with `pipeline.cross_stage_indices=true`, the indices cross the boundary.
The checkpoint is `serve.checkpoint` (generate, or `plan` with mode=serve), or the run dir's newest checkpoint when
`train.resume=true`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable, Optional, Set

from dsaflow.errors import PlanError
from dsaflow.plan.partition import declared_roles
from dsaflow.rundir.folder import MANIFEST, list_checkpoints

_INDEXER_KEY = re.compile(r"^layers\.(\d+)\.attn\.indexer\.")


def _weight_folder(path: Path) -> Optional[Path]:
    """A checkpoint folder, or a run dir's newest checkpoint folder holding weights (None if there is none)."""
    if (path / MANIFEST).is_file() or any(path.glob("model-rank*.safetensors")):
        return path
    for _, folder in list_checkpoints(path):
        if any(folder.glob("model-rank*.safetensors")):
            return folder
    return None


def indexer_layers(folder: Path) -> Optional[Set[int]]:
    """Global indices of the layers whose indexer weights the checkpoint holds; None if it has no weight files or
    their headers are unreadable (the weight loader reports that with its own fix)."""
    files = sorted(folder.glob("model-rank*.safetensors"))
    if not files:
        return None
    # imported here: safetensors_io imports torch, which a launch's parent process otherwise never needs (~1.2 s)
    from dsaflow.checkpoint.safetensors_io import SafetensorsError, read_header

    layers: Set[int] = set()
    for f in files:
        try:
            header, _ = read_header(f)
        except (SafetensorsError, OSError):
            return None
        layers.update(int(m.group(1)) for m in map(_INDEXER_KEY.match, header) if m)
    return layers


def checkpoint_of(cfg, command: str) -> Optional[Path]:
    """The weights this command will load: serve.checkpoint (generate, and `plan` in serve mode: the plan shows what
    generate would run), the run dir's own (train with resume)."""
    if (command == "generate" or (command == "plan" and cfg.mode == "serve")) and cfg.serve.checkpoint:
        return _weight_folder(Path(cfg.serve.checkpoint))
    if command == "train" and cfg.train.resume and cfg.run_dir:
        return _weight_folder(Path(cfg.run_dir))
    return None


def _short(ids) -> str:
    ids = sorted(ids)
    return f"{ids[:8]}{' ...' if len(ids) > 8 else ''}"


def plan_for_checkpoint(cfg, command: str, build: Callable, report: Callable[[str], None] = None):
    """`build(cfg)` -> Plan, adjusted to the checkpoint's indexer weights (see the module docstring)."""
    folder = checkpoint_of(cfg, command)
    have = indexer_layers(folder) if folder is not None else None
    if have is None:
        return build(cfg)
    field = "train.resume" if command == "train" else "serve.checkpoint"
    roles, _ = declared_roles(cfg)
    missing_f = [i for i, r in enumerate(roles) if r == "F" and i not in have]
    if missing_f:
        raise PlanError(
            f"{field}: the checkpoint {folder} has no indexer weights on layers {_short(missing_f)}, which the config "
            f"declares F (they would run an indexer that was never trained). Fix: use the layout the checkpoint was "
            f"trained with (its F layers: {_short(have)}), e.g. the training run's index=/layout= overrides."
        )
    plan = build(cfg)
    lacking = [l.index for l in plan.layers if l.promoted and l.index not in have]
    if not lacking:
        return plan
    cfg.index.promote = False
    (report or _stderr)(
        f"dsaflow: {field}: the checkpoint {folder} has no indexer weights on its S layers (the plan would promote "
        f"layers {_short(lacking)} to F), so it is planned with index.promote=false: stages start on F, or the "
        f"indices cross with pipeline.cross_stage_indices=true."
    )
    return build(cfg)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
