"""Files for the bad-input tests: crafted checkpoints (an executing pickle), data files, prompt files, run dirs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class Exploit:
    """Unpickling this runs a shell command that creates `marker`: what a crafted DCP `.metadata` could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def snapshot(root: Path) -> dict:
    """{relative path: bytes or link target}: what is on disk under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = ("link", os.readlink(p)) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


def crafted_checkpoint(folder: Path, marker: Path, step: int = 1) -> Path:
    """A checkpoint folder whose `.metadata` executes a command when unpickled, with a matching manifest (an
    attacker writes the manifest too), so only the metadata reader stands between the file and the command."""
    from dsaflow.checkpoint.store import write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    write_manifest(folder, step)
    return folder


def crafted_run_dir(run_dir: Path, marker: Path, overrides=()) -> Path:
    """A run dir (config.yaml + plan.json from `overrides`) whose only checkpoint is `crafted_checkpoint`."""
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan, render_table
    from dsaflow.rundir.folder import write_run_dir

    cfg = compose(["track=none", *overrides, f"run_dir={run_dir}"])
    plan = build_plan(cfg)
    write_run_dir(cfg, plan, render_table(plan, cfg))
    crafted_checkpoint(run_dir / "checkpoints" / "step-000001", marker)
    return run_dir
