"""Training MoE models: PP=1 against PP=2 / PP=4 under every schedule (gloo, CPU; routed experts, shared expert,
group-limited routing, the bias update and the balance loss all on), the bias update against a skewed router, and the
expert-load metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_train_pipeline import LAYOUTS_2, LAYOUTS_4, STEPS, _assert_same
from train_harness import run_configs, stop_and_resume_cfgs, tiny_cfg

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.model import expert_load_balance, update_expert_bias
from dsaflow.model.init import init_module
from dsaflow.model.moe import MoE
from dsaflow.rundir.folder import read_metrics

MOE = MoEConfig(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_inter_dim=32,
    n_shared_experts=1,
    n_group=2,
    topk_group=2,
    first_k_dense=1,
    routed_scaling_factor=1.5,
    bias_update_rate=0.01,
    aux_loss_weight=0.01,
)
COMMON = dict(steps=STEPS, dense_warmup_steps=1, final_ckpt=False)  # no comparison reads a final checkpoint


def moe_cfg(stages, ranks, schedule, **train):
    cfg = tiny_cfg(stages, ranks, schedule, **train)
    cfg.model.moe = dataclasses.replace(MOE)
    return cfg


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return run_configs(1, [moe_cfg(1, None, "1F1B", **COMMON)], tmp_path_factory.mktemp("moe_pp1"))[0]


def _assert_same_balance(ref, got, label):
    for r, g in zip(ref["history"], got["history"]):
        keys = [k for k in r if "expert_load" in k]
        assert keys == [k for k in g if "expert_load" in k], label
        for key in keys:
            assert abs(r[key] - g[key]) <= 1e-9, (label, key, r[key], g[key])


def test_moe_training_moves_the_loss_and_logs_expert_load(moe_reference):
    h = moe_reference["history"]
    assert len({round(x["loss"], 6) for x in h}) == STEPS
    # step 0 is the dense warm-up: the main model (experts too) is frozen, nothing is counted or reported
    assert not any("expert_load" in k for k in h[0])
    assert all(x["expert_load_max"] >= 1.0 >= x["expert_load_min"] for x in h[1:])
    assert all(f"layer{i}_expert_load_max" in h[-1] for i in range(1, 8)) and "layer0_expert_load_max" not in h[-1]
    grads = moe_reference["grads"][1]
    routed = [k for k in grads if ".mlp.experts." in k or ".mlp.gate.weight" in k]
    assert routed and all(grads[k].abs().sum() > 0 for k in routed)


def resume_cfgs(root):
    """(uninterrupted, stopped after step 3, resumed) runs of test_a_resumed_moe_run_carries_its_expert_biases."""
    common = dict(steps=5, ckpt_every=2, dense_warmup_steps=1, eval_every=0)
    cfgs = stop_and_resume_cfgs(root, 2, 2, "1F1B", 3, **common)
    for cfg in cfgs:
        cfg.model.moe = dataclasses.replace(MOE, bias_update_rate=0.05)  # large steps: a lost bias would show
    return cfgs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this file in one start of 2 processes (each start costs a rendezvous and a first-run
    warm-up per rank): the LAYOUTS_2 runs, 1F1B with train.recompute=block, then the stop-and-resume triple ->
    (results of the first two groups, the resume configs, whose run dirs the test reads)."""
    root = tmp_path_factory.mktemp("moe_pp2")
    cfgs = [moe_cfg(s, r, sched, **COMMON) for s, r, sched in LAYOUTS_2]
    cfgs.append(moe_cfg(2, 2, "1F1B", recompute="block", **COMMON))
    resume = resume_cfgs(root)
    got = run_configs(2, [*cfgs, *resume], root / "out")
    return got[: len(cfgs)], resume


@pytest.mark.slow
def test_moe_pp2_every_schedule_matches_pp1(moe_reference, two_ranks):
    for (s, r, sched), got in zip(LAYOUTS_2, two_ranks[0]):
        _assert_same(moe_reference, got, f"MoE {sched} {s} stages / {r} ranks")
        _assert_same_balance(moe_reference, got, f"MoE {sched}")


@pytest.mark.slow
def test_moe_pp4_and_block_recompute_match_pp1(moe_reference, two_ranks, tmp_path):
    layouts = LAYOUTS_4 + [(2, 2, "1F1B")]
    cfgs4 = [moe_cfg(s, r, sched, **COMMON) for s, r, sched in LAYOUTS_4]
    got = run_configs(4, cfgs4, tmp_path / "pp4") + two_ranks[0][len(LAYOUTS_2) :]
    assert len(got) == len(layouts)
    for (s, r, sched), g in zip(layouts, got):
        _assert_same(moe_reference, g, f"MoE {sched} {s} stages / {r} ranks")
        _assert_same_balance(moe_reference, g, f"MoE {sched}")


def _skewed_run(rate: float, steps: int = 60) -> list[float]:
    """One MoE layer (8 experts, 2 per token, 2 groups) learning a random linear map from 2048 fresh random tokens a
    step, from a router whose bias makes expert 0 every token's choice: max / mean expert load per step, with the
    bias update at `rate` after each AdamW step (the Trainer's order)."""
    torch.manual_seed(0)
    layer = MoE(64, MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_inter_dim=32, n_group=2, topk_group=2))
    init_module(layer, torch.Generator().manual_seed(1), 0.02)
    with torch.no_grad():
        layer.gate.e_score_correction_bias[0] = 0.1
    teacher = torch.randn(64, 64) / 8
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    balance = []
    for _ in range(steps):
        x = torch.randn(1, 2048, 64, generator=gen)
        F.mse_loss(layer(x, count_load=True), x @ teacher).backward()
        opt.step()
        opt.zero_grad()
        balance.append(expert_load_balance(layer)[0].item())
        update_expert_bias(layer, rate)
    return balance


def test_the_bias_update_balances_a_skewed_router_and_training_alone_does_not():
    with_update, without = _skewed_run(0.01), _skewed_run(0.0)
    assert with_update[0] > 3.5 and without[0] > 3.5  # 4 = every token's first choice is expert 0
    first_balanced = next(i for i, v in enumerate(with_update) if v < 1.3)
    assert first_balanced <= 10, with_update  # measured: step 5
    assert sum(with_update[-20:]) / 20 < 1.3, with_update  # it stays balanced (measured: 1.1 to 1.4, mean 1.24)
    assert min(without) > 1.5, without  # measured: 3.8 falling to 2.1 in 60 steps


@pytest.mark.slow
def test_a_resumed_moe_run_carries_its_expert_biases(two_ranks):
    """Stop after step 3, resume from the step-2 checkpoint: the losses and expert loads equal the uninterrupted
    run's, which needs the selection biases the bias update had moved (they live in the checkpoint). The three runs
    are the last of the `two_ranks` spawn (resume_cfgs)."""
    full, stopped, _ = two_ranks[1]
    want, got = read_metrics(full.run_dir), read_metrics(stopped.run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r.get("expert_load_max") for r in got] == [r.get("expert_load_max") for r in want]
