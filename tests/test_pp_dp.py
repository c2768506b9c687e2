"""Pipeline x data parallelism on CPU (gloo): pp2 x dp2 (4 processes) trains exactly as pp2 x dp1 with twice the
microbatches (the same global batch, fp32), with FSDP2 sharding on and off, under 1F1B and Interleaved1F1B; a
checkpoint written at dp2 resumes at dp1 with the uninterrupted run's losses; sharded runs with the dense
warm-up and from a checkpoint's weights (train.init_from) match too; MoE routing biases stay equal across
replicas; and the planner, the launch and resume refuse layouts that do not fit, naming the field and the fix."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from test_moe_train import MOE
from train_harness import GRAD_STEPS, run_configs, tiny_cfg

from dsaflow.errors import PlanError
from dsaflow.plan import build_plan
from dsaflow.rundir.folder import checkpoint_dir

STEPS = 3
# (stages, ranks, schedule, microbatches of one dp1 pipeline): the dp2 runs take half the microbatches each
SCHEDULES = {"1F1B": (2, 2, "1F1B", 4), "Interleaved1F1B": (4, 2, "Interleaved1F1B", 4)}


def ppdp_cfg(schedule: str, dp: int = 1, shard: bool = True, moe: bool = False, **train):
    stages, ranks, sched, microbatches = SCHEDULES[schedule]
    # final_ckpt: only the step-2 checkpoint (ckpt_every=2) is read, by the resume and the "from a checkpoint" runs
    cfg = tiny_cfg(stages, ranks, sched, **{"steps": STEPS, "final_ckpt": False, **train})
    cfg.pipeline.microbatches = microbatches // dp  # same global batch (8) and microbatch size (2) at any dp
    cfg.parallel.dp, cfg.parallel.dp_shard = dp, shard
    if moe:
        cfg.model.moe = dataclasses.replace(MOE)
    return cfg


# dense_warmup_steps=1: step 0 trains only the indexers in the forward-only pass, whose backward runs outside the
# schedule (sharded: reduced by DataParallel.after_stage_backward, not by FSDP2's hooks)
DP2_RUNS = {
    "1F1B sharded": ppdp_cfg("1F1B", 2, True),
    "1F1B sharded, dense warm-up": ppdp_cfg("1F1B", 2, True, dense_warmup_steps=1),
    "1F1B replicated, dense warm-up": ppdp_cfg("1F1B", 2, False, dense_warmup_steps=1),
    "Interleaved1F1B sharded": ppdp_cfg("Interleaved1F1B", 2, True),
    "Interleaved1F1B replicated": ppdp_cfg("Interleaved1F1B", 2, False),
    "MoE 1F1B sharded": ppdp_cfg("1F1B", 2, True, moe=True),
    # stopped after step 2 with a checkpoint there: resumed at dp1 by `dp1` below, and the weights both
    # "from a checkpoint" runs start from
    "stopped at step 2": ppdp_cfg("1F1B", 2, True, ckpt_every=2, stop_at_step=2),
    "1F1B sharded, from a checkpoint": ppdp_cfg("1F1B", 2, True),
}
REFERENCE_OF = {
    "1F1B sharded": "1F1B",
    "1F1B sharded, dense warm-up": "1F1B dense warm-up",
    "1F1B replicated, dense warm-up": "1F1B dense warm-up",
    "Interleaved1F1B sharded": "Interleaved1F1B",
    "Interleaved1F1B replicated": "Interleaved1F1B",
    "MoE 1F1B sharded": "MoE 1F1B",
    "1F1B sharded, from a checkpoint": "1F1B from a checkpoint",
}


def _init_from(root) -> str:
    """train.init_from of the "from a checkpoint" runs: the step-2 checkpoint folder itself, since resuming at dp1
    adds a newer one to that run dir."""
    return str(checkpoint_dir(root / "resumable", 2))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2")
    cfgs = list(DP2_RUNS.values())
    DP2_RUNS["stopped at step 2"].run_dir = str(root / "resumable")
    DP2_RUNS["1F1B sharded, from a checkpoint"].train.init_from = _init_from(root)
    return dict(zip(DP2_RUNS, run_configs(4, cfgs, root / "out"))), root


@pytest.fixture(scope="module")
def dp1(dp2, tmp_path_factory):
    """The dp1 references (2 processes), and the dp2 checkpoint resumed at dp1."""
    resumed = ppdp_cfg("1F1B", 1, True, ckpt_every=2, resume=True)
    resumed.run_dir = str(dp2[1] / "resumable")
    runs = {
        "1F1B": ppdp_cfg("1F1B"),
        "1F1B dense warm-up": ppdp_cfg("1F1B", dense_warmup_steps=1),
        "Interleaved1F1B": ppdp_cfg("Interleaved1F1B"),
        "MoE 1F1B": ppdp_cfg("1F1B", moe=True),
        "1F1B from a checkpoint": ppdp_cfg("1F1B", init_from=_init_from(dp2[1])),
        "resumed at dp1": resumed,
    }
    return dict(zip(runs, run_configs(2, list(runs.values()), tmp_path_factory.mktemp("dp1"))))


# The PP=1 vs PP=2 tolerances (tests/test_train_pipeline.py) hold for the LM loss and every main-model gradient.
# Data parallelism also changes the order in which microbatch gradients are summed (dp1: g0+g1+g2+g3; dp2: g0+g1
# and g2+g3 on two replicas, then their sum), and the indexer KL near 5e-5 and its gradients are differences of
# much larger terms: there the fp32 rounding of that order shows as up to 1.3e-5 relative on an indexer gradient
# and 1.2e-8 absolute on the indexer loss (measured: sharded and replicated runs give bit-identical numbers, so
# this is the summation order, not the sharding), against 1e-5 and about 1e-8 across pipeline layouts.
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5
INDEXER_LOSS_ATOL, INDEXER_GRAD_RTOL = 3e-8, 5e-5
# A gradient relative to its own norm is the wrong yardstick where that norm is a small difference of large terms
# (a norm weight's gradient sums dy * x over every token, with both signs: layer 7's q_norm one step after a
# checkpoint is 1e-7 of the clipped total). Reassociating a sum of fp32 terms moves it by about sqrt(n) * u *
# (their magnitude), u = 2^-24; here n = 4 microbatch partials, each bounded by the step's gradient norm G (the
# clipped global norm, 1 with grad_clip=1), so sqrt(4) * u * G; step 1 adds step 0's update difference, which
# Adam passes on at most 1:1 in relative terms (d(g / (|g| + eps)) / dg * |g| <= 1), so twice that: each tensor may
# differ by GRAD_RTOL of its own norm plus 4 * u * G. Measured: at most 6e-10 * G (a bug, such as a replica's
# gradient dropped or counted twice, moves a tensor by a fair part of its norm, 1e-7 * G and up).
REASSOCIATION_FLOOR = 4 * 2.0**-24


def _assert_same(ref, got, label):
    assert len(got["losses"]) == STEPS, label
    for a, b in zip(ref["losses"], got["losses"]):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"{label}: losses {got['losses']} vs dp1 {ref['losses']}"
    for r, g in zip(ref["history"], got["history"]):
        assert abs(r["indexer_loss"] - g["indexer_loss"]) <= LOSS_RTOL * r["indexer_loss"] + INDEXER_LOSS_ATOL, (
            label,
            r["indexer_loss"],
            g["indexer_loss"],
        )
    for step in GRAD_STEPS:
        r, g = ref["grads"][step], got["grads"][step]
        assert g.keys() == r.keys(), f"{label} step {step}: {sorted(set(g) ^ set(r))[:4]}"
        assert any(g[k].abs().sum() > 0 for k in r if ".attn.indexer." in k), f"{label}: no indexer gradient"
        floor = REASSOCIATION_FLOOR * torch.sqrt(sum(t.double().norm() ** 2 for t in r.values())).item()
        for k in r:
            err, norm = (g[k] - r[k]).norm().item(), r[k].norm().item()
            rtol = INDEXER_GRAD_RTOL if ".attn.indexer." in k else GRAD_RTOL
            assert err <= rtol * norm + floor, (
                f"{label} step {step} {k}: gradient error {err:.2e}, {err / max(norm, 1e-30):.2e} of its norm "
                f"{norm:.2e} (allowed {rtol:.0e} of it + {floor:.1e})"
            )


@pytest.mark.slow
@pytest.mark.parametrize("label", list(REFERENCE_OF))
def test_pp2_dp2_matches_pp2_dp1(dp1, dp2, label):
    """Losses, indexer losses and (gathered) gradients of steps 0 and 1 against one replica with twice the
    microbatches: the same global batch in the same microbatches."""
    _assert_same(dp1[REFERENCE_OF[label]], dp2[0][label], f"pp2 x dp2 {label}")


@pytest.mark.slow
def test_the_comparison_is_not_vacuous(dp1):
    h = dp1["1F1B"]["history"]
    assert len({round(x["loss"], 6) for x in h}) == STEPS  # the loss moves
    assert h[0]["grad_norm"] > 0 and all(x["indexer_loss"] > 0 for x in h)


@pytest.mark.slow
def test_init_from_really_loads_the_checkpoint(dp1, dp2):
    """The "from a checkpoint" runs start where the stopped run's step 2 left off: their first loss is below a
    fresh run's, not the random initialisation's (which would make their comparison say nothing about loading)."""
    fresh, loaded = dp1["1F1B"]["losses"], dp2[0]["1F1B sharded, from a checkpoint"]["losses"]
    assert loaded[0] < fresh[0] - 0.05, (loaded, fresh)


@pytest.mark.slow
def test_moe_routing_biases_stay_equal_across_replicas(dp1, dp2):
    got, ref = dp2[0]["MoE 1F1B sharded"], dp1["MoE 1F1B"]
    by_stage: dict = {}
    for r in got["ranks"]:
        by_stage.setdefault(r["pp_rank"], []).append(r["biases"])
    ref_biases = {k: v for r in ref["ranks"] for k, v in r["biases"].items()}
    assert ref_biases and any(v.abs().sum() > 0 for v in ref_biases.values()), "the biases must have moved"
    for replicas in by_stage.values():
        assert len(replicas) == 2 and replicas[0].keys() == replicas[1].keys()
        for k in replicas[0]:
            assert torch.equal(replicas[0][k], replicas[1][k]), k  # bit for bit: the same summed load
            assert torch.allclose(replicas[0][k], ref_biases[k]), k  # and the update of the dp1 global batch
    assert "expert_load_max" in got["history"][-1]


@pytest.mark.slow
def test_a_dp2_checkpoint_resumes_at_dp1_with_equal_losses(dp1, dp2):
    stopped, resumed, full = dp2[0]["stopped at step 2"], dp1["resumed at dp1"], dp1["1F1B"]
    assert [h["step"] for h in stopped["history"]] == [1, 2]
    assert [h["step"] for h in resumed["history"]] == [3]
    for a, b in zip(full["losses"], stopped["losses"] + resumed["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (full["losses"], stopped["losses"], resumed["losses"])


def test_plan_counts_the_world_and_the_global_batch():
    plan = build_plan(ppdp_cfg("1F1B", 2))
    p = plan.pipeline
    assert (p.ranks, p.dp, p.world_size, p.microbatches) == (2, 2, 4, 2)
    assert [p.global_rank(d, r) for d in range(2) for r in range(2)] == [0, 1, 2, 3]
    assert p.mesh_coords(3) == (1, 1)
    assert plan.estimates["microbatch_tokens"] == 2 * 32  # 8 sequences / (dp 2 x 2 microbatches) of 32 tokens
    sharded = plan.estimates["stages"][0]["train_memory_bytes"]
    whole = build_plan(ppdp_cfg("1F1B", 2, shard=False)).estimates["stages"][0]["train_memory_bytes"]
    params = plan.estimates["stages"][0]["params"]
    name = "weights and AdamW state"
    # 12 bytes a parameter whole, 12 / dp sharded plus the 4 of the weights gathered for the step (the bf16
    # autocast copies are the same in both)
    assert whole[name] - sharded[name] == 12 * params - (6 * params + 4 * params)


def _plan_error(cfg, **kw) -> str:
    with pytest.raises(PlanError) as exc:
        build_plan(cfg, **kw)
    return str(exc.value)


def test_bad_layouts_name_the_field_and_the_fix():
    cfg = ppdp_cfg("1F1B", 2)
    cfg.train.batch_size = 6  # 6 rows do not make 2 replicas of 2 microbatches
    msg = _plan_error(cfg)
    assert "train.batch_size=6" in msg and "parallel.dp=2" in msg and "Fix: train.batch_size=4" in msg
    msg = _plan_error(ppdp_cfg("1F1B", 2), nproc=2)
    assert "--nproc 2" in msg and "4 processes" in msg and "--nproc 4" in msg and "parallel.dp=1" in msg
    serve = ppdp_cfg("1F1B", 2)
    serve.mode = "serve"  # serving replicas (tests/test_serve_replicas.py): a batch that does not split is moot
    serve.train.batch_size = 6
    assert build_plan(serve).pipeline.world_size == 4


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_sharding_refuses_split_backward_schedules(schedule):
    cfg = ppdp_cfg("Interleaved1F1B", 2)
    cfg.pipeline.schedule = schedule
    msg = _plan_error(cfg)
    assert f"pipeline.schedule={schedule}" in msg and "weight-gradient pass" in msg, msg
    assert "Fix: parallel.dp_shard=false" in msg and "pipeline.schedule=Interleaved1F1B" in msg, msg
    cfg.parallel.dp_shard = False
    build_plan(cfg)  # replicated stages run it


def test_sharding_plans_what_it_now_runs(tmp_path):
    """The dense warm-up and starting from other weights (train.init_from, model.hf_path) plan sharded."""
    for field, value in (("dense_warmup_steps", 1), ("dsa_stage", "dense_warmup"), ("init_from", str(tmp_path))):
        assert build_plan(ppdp_cfg("1F1B", 2, **{field: value})).pipeline.dp_shard, field
    cfg = ppdp_cfg("1F1B", 2)
    cfg.model.hf_path = str(tmp_path)
    assert build_plan(cfg).pipeline.dp_shard


def test_worker_refuses_a_world_that_is_not_pp_times_dp(monkeypatch, tmp_path):
    from dsaflow.worker import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError) as exc:
        check_world_size(build_plan(ppdp_cfg("1F1B", 2)), str(tmp_path))
    assert "WORLD_SIZE=2" in str(exc.value) and "2 pipeline ranks x parallel.dp=2 = 4 ranks" in str(exc.value)


def test_cli_exits_2_with_one_paragraph():
    """The front door: a dp that does not divide the batch is exit status 2 with the field and the fix."""
    out = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", "plan", "pipeline=pp2", "parallel.dp=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "parallel.dp=3" in out.stderr and "Fix:" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "pipeline,dp,local,ok",
    [
        ("pp2", 2, 2, True),  # each node one whole pipeline
        ("pp2", 2, 4, True),  # each node two
        ("pp4", 2, 2, True),  # each pipeline two whole nodes
        ("pp2", 3, 3, False),  # node 0 holds replica 0 and half of replica 1
        ("pp4", 1, 3, True),  # dp=1: one pipeline over the nodes, as before
    ],
)
def test_worker_refuses_nodes_that_cut_pipelines(monkeypatch, pipeline, dp, local, ok):
    from dsaflow.worker import check_node_size

    cfg = ppdp_cfg("1F1B", dp)
    cfg.pipeline.ranks = cfg.pipeline.stages = int(pipeline[2:])
    cfg.pipeline.microbatches = 4
    cfg.train.batch_size = 4 * dp
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    plan = build_plan(cfg)
    if ok:
        check_node_size(plan)
        return
    with pytest.raises(PlanError) as exc:
        check_node_size(plan)
    msg = str(exc.value)
    assert msg.startswith("LOCAL_WORLD_SIZE=3") and "parallel.dp=3" in msg and "a multiple of 2" in msg, msg
