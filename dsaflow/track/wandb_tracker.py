"""wandb behind the Tracker interface. Offline by default (writes `<run_dir>/wandb/offline-run-*`, sync later with
`wandb sync`); `track.mode=online` streams to the server and needs `WANDB_API_KEY` or `wandb login`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from dsaflow.files import MissingFile, atomic_write, read_text

from .base import Tracker


class WandbTracker(Tracker):
    def __init__(self, track_cfg, run_dir: str, run_name: Optional[str] = None, resume: bool = False):
        """resume=True continues the wandb run whose id an earlier attempt stored in <run_dir>/wandb/run_id."""
        import wandb  # imported here so that `track=none` runs never load it

        self._wandb = wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = Path(run_dir) / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        resume_id = None
        if resume:
            try:
                resume_id = read_text(id_file, inside=id_file.parent, max_bytes=256).strip() or None
            except MissingFile:
                pass
        self.run = wandb.init(
            project=track_cfg.project,
            entity=track_cfg.entity,
            name=track_cfg.run_name or run_name,
            tags=list(track_cfg.tags or []),
            group=getattr(track_cfg, "group", None),  # a multirun's jobs share the sweep's name
            mode=track_cfg.mode,
            dir=str(run_dir),
            id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        atomic_write(id_file, self.run.id)  # never through a link planted in the run dir

    @property
    def run_id(self) -> str:
        return self.run.id

    def log_config(self, cfg_dict: Mapping[str, Any], plan_dict: Mapping[str, Any]) -> None:
        self.run.config.update({"config": dict(cfg_dict), "plan": dict(plan_dict)}, allow_val_change=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()
