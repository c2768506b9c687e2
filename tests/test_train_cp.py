"""parallel.cp in the trainer (gloo, CPU, fp32): cp2 and pp2 x cp2 (1F1B and Interleaved1F1B) give the losses, the
indexer KL and every gradient (weights and indexers) of cp1 over 4 steps; a resumed cp2 run equals the uninterrupted
one; and what cp does not run is refused by name before launch."""

from __future__ import annotations

import pytest
from train_harness import GRAD_STEPS, run_configs, stop_and_resume_cfgs, tiny_cfg

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.errors import PlanError
from dsaflow.model.mtp import mtp_runs_in_training
from dsaflow.plan import build_plan

STEPS = 4
COMMON = dict(steps=STEPS, final_ckpt=False, loss_chunk_tokens=24)


def _cp(cfg, cp: int):
    cfg.parallel.cp = cp
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """cp1 (1 rank); cp2 uninterrupted, stopped after step 2 and resumed (2 ranks); pp2 x cp2 under 1F1B and
    Interleaved1F1B (4 ranks)."""
    root = tmp_path_factory.mktemp("cp")
    (ref,) = run_configs(1, [tiny_cfg(1, None, "1F1B", **COMMON)], root / "cp1")
    resume = dict(COMMON, ckpt_every=2)  # the stopped run saves at step 2, where it stops (saving changes nothing)
    cfgs2 = [_cp(c, 2) for c in stop_and_resume_cfgs(root / "resume", 1, None, "1F1B", 2, **resume)]
    untrained_mtp = _cp(tiny_cfg(1, None, "1F1B", **COMMON, mtp_loss_weight=0.0), 2)
    untrained_mtp.model.mtp_layers = 1
    full_r, _, resumed_r, mtp_r = run_configs(2, [*cfgs2, untrained_mtp], root / "cp2")
    cfgs4 = [_cp(tiny_cfg(2, 2, "1F1B", **COMMON), 2), _cp(tiny_cfg(4, 2, "Interleaved1F1B", **COMMON), 2)]
    pp2_1f1b, pp2_interleaved = run_configs(4, cfgs4, root / "pp2cp2")
    return {
        "cp1": ref,
        "cp2": full_r,
        "pp2 x cp2 1F1B": pp2_1f1b,
        "pp2 x cp2 Interleaved1F1B": pp2_interleaved,
        "full": full_r,
        "resumed": resumed_r,
        "cp2 with an untrained MTP layer": mtp_r,
    }


# The indexer KL (~3e-5 here) is a mean over queries of sum_k t_k (log t_k - log s_k), terms of size up to log(topk)
# each rounded to fp32; cp ranks take the mean over their own queries, then over ranks: an absolute slack of a few
# ulps of log(topk) = log(8), 4 * 2**-23 * 2.08 = 1e-6 (a KL of a wrong set of queries moves by its own size)
KL_SLACK = 1e-6
# The indexer's gradient is that of the KL, softmax(index scores) - target over the key set: at a KL of 3e-5 the two
# distributions agree to about sqrt(3e-5) = 5e-3 of their size, so fp32 rounding of either (~1e-7) is ~2e-5 of the
# gradient; 1e-4 leaves a few of those and still fails a gradient of a wrong key set or query set
INDEXER_GRAD_RTOL = 1e-4


def _assert_same(ref, got, label):
    """Tolerances as the PP tests': the shards sum the same fp32 terms in another order."""
    assert len(got["losses"]) == STEPS, label
    for a, b in zip(ref["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), f"{label}: losses {got['losses']} vs cp1 {ref['losses']}"
    for r, g in zip(ref["history"], got["history"]):
        assert abs(r["indexer_loss"] - g["indexer_loss"]) <= 1e-5 * r["indexer_loss"] + KL_SLACK, (label, r, g)
    # the evaluation at the end: forward-only pipelined passes over held-out batches, each rank on its shard
    assert (
        abs(ref["history"][-1]["eval_loss"] - got["history"][-1]["eval_loss"]) <= 1e-5 * ref["history"][-1]["eval_loss"]
    )
    for step in GRAD_STEPS:
        r, g = ref["grads"][step], got["grads"][step]
        assert g.keys() == r.keys(), f"{label} step {step}: {sorted(set(g) ^ set(r))[:4]}"
        assert any(".attn.indexer." in k and g[k].abs().sum() > 0 for k in g), label
        for k in r:
            err = (g[k] - r[k]).norm() / r[k].norm().clamp_min(1e-12)
            tol = INDEXER_GRAD_RTOL if ".attn.indexer." in k else 1e-5
            assert err < tol, f"{label} step {step} {k}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("label", ["cp2", "pp2 x cp2 1F1B", "pp2 x cp2 Interleaved1F1B"])
def test_context_parallel_equals_cp1(runs, label):
    _assert_same(runs["cp1"], runs[label], label)


def test_the_comparison_is_not_vacuous(runs):
    losses = runs["cp1"]["losses"]
    assert len(set(round(l, 6) for l in losses)) == len(losses)
    assert all(h["indexer_loss"] > 0 for h in runs["cp1"]["history"])


def test_a_resumed_cp2_run_equals_the_uninterrupted_one(runs):
    full, resumed = runs["full"]["losses"], runs["resumed"]["losses"]
    assert len(full) == STEPS and len(resumed) == STEPS - 2
    assert resumed == pytest.approx(full[2:], rel=1e-6)


def test_the_plan_counts_cp_in_the_world_and_shards_the_sequence():
    plan = build_plan(compose(["pipeline=pp2", "parallel.cp=2", "train.seq_len=64", "train.batch_size=4"]))
    p = plan.pipeline
    assert (p.cp, p.world_size, p.replicas) == (2, 4, 2)
    assert [p.global_rank(0, pp, c) for c in range(2) for pp in range(2)] == [0, 1, 2, 3]
    assert p.cp_index(3) == 1 and p.mesh_coords(3) == (0, 1)
    # per rank: half of each sequence
    assert plan.estimates["microbatch_tokens"] == 64 // 2 * (4 // p.microbatches)


BAD = [
    (["parallel.cp=0"], "parallel.cp"),
    (["parallel.cp=2", "train.seq_len=30"], "train.seq_len=30 does not split into 2 x parallel.cp=2 = 4"),
    (["parallel.cp=2", "pipeline=pp4_interleaved", "pipeline.schedule=InterleavedZeroBubble"], "input and a weight"),
    (["parallel.cp=2", "train.recompute=attention"], "train.recompute=block"),
    (["parallel.cp=2", "train.dense_warmup_steps=2"], "dense warm-up"),
    (["parallel.cp=2", "mode=serve"], "mode=serve does not train"),
    (["parallel.cp=2", "model=tiny_moe", "model.moe.aux_loss_weight=0.01"], "model.moe.aux_loss_weight=0.01 with"),
    (["parallel.cp=2", "model.mtp_layers=1"], "model.mtp_layers=1 with train.mtp_loss_weight=0.1 and parallel.cp=2"),
]


@pytest.mark.parametrize("args, needle", BAD)
def test_what_cp_does_not_run_exits_2_naming_the_field(capsys, args, needle):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_process_count_that_is_not_pp_x_dp_x_cp_is_refused():
    cfg = compose(["pipeline=pp2", "parallel.cp=2"])
    with pytest.raises(PlanError, match="--nproc 3 but .* x parallel.cp=2 = 4 processes"):
        build_plan(cfg, nproc=3)
    assert build_plan(cfg, nproc=4).pipeline.world_size == 4


def test_cross_stage_indices_are_refused_with_cp():
    cfg = compose(["pipeline=pp2", "parallel.cp=2", "pipeline.cross_stage_indices=true", "index=every4"])
    with pytest.raises(PlanError, match="pipeline.cross_stage_indices=true with parallel.cp=2"):
        build_plan(cfg)


def test_an_untrained_mtp_layer_under_cp_is_carried_through(runs):
    """model.mtp_layers=1 at train.mtp_loss_weight=0 under cp2: the MTP layer never runs (no gradient, no
    `mtp_loss`) and the main model trains exactly as without it."""
    got, ref = runs["cp2 with an untrained MTP layer"], runs["cp2"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert not any("mtp_loss" in h for h in got["history"])
    for step in GRAD_STEPS:
        assert got["grads"][step].keys() == ref["grads"][step].keys()


def test_mtp_layers_plan_under_cp_untrained_only():
    """With train.mtp_loss_weight=0 the MTP layers (a checkpoint's, say) plan under cp: training does not run them
    there (their depth-k tokens cross the zigzag chunks); at cp=1 it does."""
    cfg = compose(["parallel.cp=2", "model.mtp_layers=1", "train.mtp_loss_weight=0"])
    assert build_plan(cfg, nproc=2).pipeline.cp == 2
    assert not mtp_runs_in_training(cfg)
    assert mtp_runs_in_training(compose(["model.mtp_layers=1"]))
