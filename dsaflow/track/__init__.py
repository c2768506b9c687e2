"""Experiment tracking kept out of core: `make_tracker` returns a Tracker (wandb) or a NullTracker."""

from __future__ import annotations

import os

from .base import NullTracker, Tracker
from .progress import Progress


def make_tracker(cfg, run_dir: str, is_logging_rank: bool, resume: bool = False) -> Tracker:
    """One tracker per run, on the logging rank (the last pipeline stage's rank); NullTracker everywhere else,
    and for `track.backend=none`, `track.mode=disabled` or wandb's own switch WANDB_MODE=disabled."""
    t = cfg.track
    off = t.backend == "none" or t.mode == "disabled" or os.environ.get("WANDB_MODE", "").lower() == "disabled"
    if not is_logging_rank or off:
        return NullTracker()
    from .wandb_tracker import WandbTracker  # the schema's TrackBackend: wandb | none

    return WandbTracker(t, run_dir, run_name=str(run_dir).rstrip("/").split("/")[-1], resume=resume)


__all__ = ["NullTracker", "Progress", "Tracker", "make_tracker"]
