"""Helpers shared by the model, cache and indexer-loss tests."""

import torch

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan

# Larger initial weights than the default 0.02: attention and index scores far from uniform, so the tests that
# compare distributions and decode paths can fail.
SHARP_INIT = "model.init_std=0.3"


def planned(layout, *overrides):
    """model=tiny with `layout` (+ Hydra overrides) -> (ModelConfig, Plan)."""
    cfg = compose(["model=tiny", f"layout={layout}", *overrides])
    return cfg.model, build_plan(cfg)


def tokens(B, T, seed=0):
    """Seeded byte tokens [B, T]."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g)


def planned_sharp(layout, *overrides):
    """`planned` with SHARP_INIT (later overrides still win)."""
    return planned(layout, SHARP_INIT, *overrides)
