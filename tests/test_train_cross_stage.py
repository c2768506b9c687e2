"""Training with cross-stage indices (gloo, CPU, fp32): every stage of the PP=2 / PP=4 splits opens on an S layer
that reads the indices of the previous stage, under all six schedules.

- The forward is the PP=1 model's: with the indexers held fixed (train.indexer_lr=0, so the top-k sets stay the
  same from step to step) every run's LM losses and main-model gradients equal a single-stage run's.
- Distillation is stage-local (docs/planning.md, "Index sharing"): an F layer's target is its own attention and that
  of the S layers on its stage. Its indexer loss and gradients therefore equal those of the same split run in one
  process (all stages on one rank), and a single-stage run's where no S layer of its group sits on a later stage.
"""

from __future__ import annotations

import pytest
from train_harness import GRAD_STEPS, run_configs, tiny_cfg

from dsaflow.plan import build_plan

ROLES = "FSSFSFSS"  # 2 stages: [0-3 | 4-7]; 4 stages: [0 1 | 2 3 | 4 5 | 6 7]: every stage after the first opens on S
LAYOUTS_2 = [
    (2, 2, "GPipe"),
    (2, 2, "1F1B"),
    (4, 2, "Interleaved1F1B"),
    (4, 2, "LoopedBFS"),
    (4, 2, "InterleavedZeroBubble"),
    (4, 2, "ZBVZeroBubble"),
]
LAYOUTS_4 = [(4, 4, "1F1B"), (4, 4, "GPipe")]
STEPS = 3
COMMON = {"steps": STEPS, "dense_warmup_steps": 1, "indexer_lr": 0.0, "final_ckpt": False}  # none is read
LOCAL_TO_ONE_STAGE = {2: ("layers.0.", "layers.5.")}  # F layers whose whole group is on one stage of the split


def cross_cfg(stages, ranks=None, schedule="1F1B"):
    cfg = tiny_cfg(stages, ranks, schedule, **COMMON)
    cfg.index.pattern = ROLES
    cfg.pipeline.cross_stage_indices = stages > 1
    return cfg


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """{1: one stage, 2: the 2-stage split on one rank, 4: the 4-stage split on one rank}."""
    cfgs = [cross_cfg(1), cross_cfg(2, 1, "Interleaved1F1B"), cross_cfg(4, 1, "Interleaved1F1B")]
    return dict(zip((1, 2, 4), run_configs(1, cfgs, tmp_path_factory.mktemp("ref"))))


def test_every_split_opens_on_s_and_sends_indices():
    for stages, ranks, sched in [(2, 1, "Interleaved1F1B"), (4, 1, "Interleaved1F1B")] + LAYOUTS_2 + LAYOUTS_4:
        plan = build_plan(cross_cfg(stages, ranks, sched))
        assert plan.index_boundaries == tuple(range(stages - 1)), (stages, ranks, sched)
        assert not any(l.promoted for l in plan.layers) and "".join(l.role for l in plan.layers) == ROLES


def _close(a, b, label, rel=1e-5):
    err = (a - b).norm() / b.norm().clamp_min(1e-12)
    assert err < rel, f"{label}: relative error {err:.2e}"


def _assert_same(refs, got, stages, label):
    one, split = refs[1], refs[stages]
    assert len(got["losses"]) == STEPS, label
    for a, b in zip(one["losses"], got["losses"]):  # the forward is the single-stage model's
        assert abs(a - b) <= 1e-5 * abs(a), f"{label}: losses {got['losses']} vs PP=1 {one['losses']}"
    for r, g in zip(split["history"], got["history"]):  # stage-local indexer loss: the same split's value
        assert abs(r["indexer_loss"] - g["indexer_loss"]) <= 1e-5 * r["indexer_loss"] + 1e-8, (label, r, g)
    for step in GRAD_STEPS:
        g = got["grads"][step]
        idx = [k for k in g if ".attn.indexer." in k]
        assert idx and any(g[k].abs().sum() > 0 for k in idx), f"{label}: indexer gradients are all zero"
        for k in g:
            if ".attn.indexer." in k:
                _close(g[k], split["grads"][step][k], f"{label} step {step} {k} vs the split on one rank")
                if k.startswith(LOCAL_TO_ONE_STAGE.get(stages, ())):
                    _close(g[k], one["grads"][step][k], f"{label} step {step} {k} vs PP=1")
            elif k in one["grads"][step]:
                _close(g[k], one["grads"][step][k], f"{label} step {step} {k} vs PP=1")


def test_one_rank_splits_differ_from_one_stage_only_in_crossing_groups(references):
    """The comparison is not vacuous: a group cut by a boundary distils fewer layers, so its gradient moves."""
    one, two = references[1], references[2]
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    g1, g2 = one["grads"][1], two["grads"][1]
    assert (g1["layers.3.attn.indexer.wk.weight"] - g2["layers.3.attn.indexer.wk.weight"]).norm() > 1e-3 * g1[
        "layers.3.attn.indexer.wk.weight"
    ].norm()
    _close(g2["layers.0.attn.indexer.wk.weight"], g1["layers.0.attn.indexer.wk.weight"], "layer 0")


@pytest.mark.slow
def test_pp2_every_schedule_carries_indices(references, tmp_path):
    cfgs = [cross_cfg(s, r, sched) for s, r, sched in LAYOUTS_2]
    for (s, r, sched), got in zip(LAYOUTS_2, run_configs(2, cfgs, tmp_path)):
        _assert_same(references, got, s, f"{sched} {s} stages / {r} ranks")


@pytest.mark.slow
def test_pp4_carries_indices(references, tmp_path):
    cfgs = [cross_cfg(s, r, sched) for s, r, sched in LAYOUTS_4]
    for (s, r, sched), got in zip(LAYOUTS_4, run_configs(4, cfgs, tmp_path)):
        _assert_same(references, got, s, f"{sched} {s} stages / {r} ranks")
