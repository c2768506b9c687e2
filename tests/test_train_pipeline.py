"""PP=1 vs PP=2 / PP=4 under every schedule (gloo, CPU): same per-step losses and the same gradients, indexer
gradients included (the stage-local indexer loss is backpropagated inside the stage, never by the schedule)."""

from __future__ import annotations

import pytest
from train_harness import GRAD_STEPS, run_configs, tiny_cfg

from dsaflow.plan import build_plan

# (stages, ranks, schedule): every schedule the planner offers, on 2 ranks; 1F1B and GPipe also on 4.
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
# step 0 dense_warmup (indexers only), then sparse; no final checkpoint (none is read here: each costs about a second)
# loss_chunk_tokens=24: the 64 tokens of a microbatch reach the loss in 3 chunks (the last one ragged)
COMMON = dict(steps=STEPS, dense_warmup_steps=1, final_ckpt=False, loss_chunk_tokens=24)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The PP=1 runs, without and with train.recompute=block (BLOCK, below), in one spawned process."""
    cfgs = [tiny_cfg(1, None, "1F1B", **COMMON), tiny_cfg(1, None, "1F1B", **BLOCK)]
    return run_configs(1, cfgs, tmp_path_factory.mktemp("pp1"))


@pytest.fixture(scope="module")
def reference(references):
    return references[0]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """Every LAYOUTS_2 and LAYOUTS_4 run, without and with train.recompute=block: one start of 2 processes and one
    of 4 (each costs a rendezvous and a first-run warm-up per rank)
    -> {(recompute, stages, ranks, schedule): result}."""
    root = tmp_path_factory.mktemp("pipelined")
    out = {}
    for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        keys = [(rc, *lay) for rc in ("none", "block") for lay in layouts]
        cfgs = [tiny_cfg(s, r, sched, **(BLOCK if rc == "block" else COMMON)) for rc, s, r, sched in keys]
        out.update(zip(keys, run_configs(world, cfgs, root / f"pp{world}")))
    return out


def _assert_same(ref, got, label):
    assert len(got["losses"]) == STEPS, label
    for a, b in zip(ref["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), f"{label}: losses {got['losses']} vs PP=1 {ref['losses']}"
    for r, g in zip(ref["history"], got["history"]):  # logged once per microbatch and stage, whatever the schedule
        # absolute slack: a KL near 3e-5 is a difference of larger terms, summed in a split-dependent order
        assert abs(r["indexer_loss"] - g["indexer_loss"]) <= 1e-5 * r["indexer_loss"] + 1e-8, (label, r, g)
    for step in GRAD_STEPS:  # step 0: dense_warmup (only indexer grads matter), step 1: sparse
        r, g = ref["grads"][step], got["grads"][step]
        assert g.keys() == r.keys(), f"{label} step {step}: {sorted(set(g) ^ set(r))[:4]}"
        idx = [k for k in r if ".attn.indexer." in k]
        assert idx, "the tiny config must have indexer weights"
        assert any(g[k].abs().sum() > 0 for k in idx), f"{label}: indexer gradients are all zero"
        for k in r:
            # Relative to the tensor's norm: schedules accumulate microbatch gradients in different orders
            # (LoopedBFS runs backwards in reverse), which moves single near-zero elements by ~1e-7.
            err = (g[k] - r[k]).norm() / r[k].norm().clamp_min(1e-12)
            assert err < 1e-5, f"{label} step {step} {k}: relative gradient error {err:.2e}"


def test_split_keeps_roles():
    """The comparison is only meaningful if no layer is promoted by the split."""
    ref = build_plan(tiny_cfg(1))
    for stages, ranks, sched in LAYOUTS_2 + LAYOUTS_4:
        plan = build_plan(tiny_cfg(stages, ranks, sched))
        assert [l.role for l in plan.layers] == [l.role for l in ref.layers], (stages, ranks, sched)
        assert not any(l.promoted for l in plan.layers)


@pytest.mark.slow
def test_pp2_every_schedule_matches_pp1(reference, pipelined):
    for s, r, sched in LAYOUTS_2:
        _assert_same(reference, pipelined["none", s, r, sched], f"{sched} {s} stages / {r} ranks")


@pytest.mark.slow
def test_pp4_matches_pp1(reference, pipelined):
    for s, r, sched in LAYOUTS_4:
        _assert_same(reference, pipelined["none", s, r, sched], f"{sched} {s} stages / {r} ranks")


def test_losses_move(reference):
    """Guard against a vacuous comparison: training changes the loss and the indexer loss is live."""
    losses = reference["losses"]
    assert len(set(round(l, 6) for l in losses)) == len(losses)
    assert all(h["indexer_loss"] > 0 for h in reference["history"])
    assert reference["history"][0]["dense"] == 1.0 and reference["history"][1]["dense"] == 0.0


# train.recompute=block: every layer keeps only its input and runs again in the backward, under every schedule (the
# zero-bubble ones recompute in their input pass and again in their weight pass).
BLOCK = dict(COMMON, recompute="block")


@pytest.fixture(scope="module")
def block_reference(references):
    return references[1]


def test_block_recompute_gives_the_losses_of_no_recompute(reference, block_reference):
    assert len(block_reference["losses"]) == STEPS
    for a, b in zip(reference["losses"], block_reference["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a), (reference["losses"], block_reference["losses"])
    for r, g in zip(reference["history"], block_reference["history"]):
        assert abs(r["indexer_loss"] - g["indexer_loss"]) <= 1e-6 * r["indexer_loss"], (r, g)
    for step in GRAD_STEPS:
        r, g = reference["grads"][step], block_reference["grads"][step]
        assert g.keys() == r.keys()
        for k in r:
            err = (g[k] - r[k]).norm() / r[k].norm().clamp_min(1e-12)
            assert err < 1e-6, f"step {step} {k}: relative gradient error {err:.2e}"


@pytest.mark.slow
def test_block_recompute_every_schedule_matches_pp1(block_reference, pipelined):
    for s, r, sched in LAYOUTS_2 + LAYOUTS_4:
        got = pipelined["block", s, r, sched]
        _assert_same(block_reference, got, f"recompute=block {sched} {s} stages / {r} ranks")
