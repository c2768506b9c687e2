"""Planning MoE models: total and active parameters against the public figures and the built model, memory of every
expert, stage cost by active FLOPs, and `model.moe` mistakes as exit 2 naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.config.moe_schema import MoEConfig, is_moe_layer
from dsaflow.config.schema import ModelConfig
from dsaflow.model import build_model
from dsaflow.plan import build_plan
from dsaflow.plan import estimates as E
from dsaflow.plan.memory import WEIGHTS, train_memory_terms


def _plan_json(capsys, *overrides):
    # a pp8 stage of a 671B / 744B model needs about a TiB to train: read the plan on a device that holds it
    assert main(["plan", "format=json", "plan.device_memory_gib=4096", *overrides]) == 0
    return json.loads(capsys.readouterr().out)


def test_deepseek_v32_plans_671b_total_and_37b_active(capsys):
    est = _plan_json(capsys, "model=dsv32", "pipeline=pp8")["estimates"]
    assert est["total"]["params"] == pytest.approx(671e9, rel=0.02)
    assert est["total"]["active_params"] == pytest.approx(37e9, rel=0.05)
    stages = est["stages"]
    assert sum(s["moe_layers"] for s in stages) == 58 and len(stages) == 8
    # a pp8 stage of V3.2 holds ~84B parameters, not the ~5B a dense MLP would give
    assert all(s["params"] > 60e9 for s in stages)


def test_glm5_plans_its_public_size_and_glm52_keeps_its_indexshare_layout(capsys):
    est = _plan_json(capsys, "model=glm5", "pipeline=pp8")["estimates"]
    assert est["total"]["params"] == pytest.approx(744e9, rel=0.02)
    plan = _plan_json(capsys, "model=glm52", "pipeline=pp8", "index.promote=false")
    assert sum(l["role"] == "F" for l in plan["layers"]) == 21
    assert all(plan["layers"][s["layers"][0]]["role"] == "F" for s in plan["stages"])


def test_layer_params_match_the_built_moe_model():
    cfg = dataclasses.replace(ModelConfig(), moe=MoEConfig(first_k_dense=2, n_shared_experts=2))
    model = build_model(cfg, roles="FSSSFSSS")
    for key, layer in model.layers.items():
        i = int(key)
        n = sum(p.numel() for p in layer.parameters())
        assert n == E.layer_params(cfg, layer.role, is_moe_layer(cfg, i)), f"layer {i}"


def test_active_flops_weigh_stages_and_mfu():
    cfg = compose(["model=tiny_moe"])
    m = cfg.model
    dense, moe = E.layer_forward_flops_per_token(m, "F", 64), E.layer_forward_flops_per_token(m, "F", 64, True)
    k, i, s = m.moe.num_experts_per_tok, m.moe.moe_inter_dim, m.moe.n_shared_experts
    assert moe - dense == 2 * (m.moe.n_routed_experts * m.dim + 3 * m.dim * i * (k + s) - 3 * m.dim * m.inter_dim)
    # training FLOPs count only the experts a token runs
    roles = [("F", 1)] * m.num_layers
    all_params = sum(E.layer_params(m, "F", is_moe_layer(m, j)) for j in range(m.num_layers))
    active = sum(E.layer_params(m, "F", is_moe_layer(m, j), active=True) for j in range(m.num_layers))
    assert E.train_flops_per_token(m, roles, 64, all_params) == pytest.approx(
        E.train_flops_per_token(dataclasses.replace(m, moe=None), roles, 64, active)
    )


def test_training_memory_counts_every_expert():
    cfg = compose(["model=tiny_moe", "pipeline=pp2"])
    plan = build_plan(cfg)
    stage = plan.stages[1]
    roles = [plan.layers[i].role for i in stage.layers]
    terms = train_memory_terms(cfg, roles, False, True, 256, 1, 2, layer_indices=list(stage.layers))
    params = sum(E.layer_params(cfg.model, r, is_moe_layer(cfg.model, i)) for r, i in zip(roles, stage.layers))
    params += E.head_params(cfg.model)
    assert terms[WEIGHTS] == 12 * params + 2 * params  # fp32 weights + AdamW moments + autocast copies
    with pytest.raises(ValueError, match="layer_indices"):
        train_memory_terms(cfg, roles, False, True, 256, 1, 2)


def test_the_plan_table_shows_total_and_active_params(capsys):
    assert main(["plan", "model=tiny_moe"]) == 0
    out = capsys.readouterr().out
    assert "(active)" in out and "active per token" in out
    assert main(["plan", "model=tiny"]) == 0
    assert "active" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ("model.moe.num_experts_per_tok=9", "model.moe.num_experts_per_tok=9 is greater than"),
        ("model.moe.topk_group=3", "model.moe.topk_group=3 is greater than model.moe.n_group=2"),
        ("model.moe.n_routed_experts=7", "model.moe.n_routed_experts=7 is not divisible"),
        ("model.moe.first_k_dense=9", "model.moe.first_k_dense=9 is above model.num_layers=8"),
        ("model.moe.first_k_dense=0 model.moe.dense_layers=[0,8]", "names layers [8]"),
        ("model.moe.dense_layers=[0]", "both choose the dense layers"),
        ("model.moe.n_routed_experts=0", "model.moe.n_routed_experts=0 is out of range"),
    ],
)
def test_moe_mistakes_exit_2_naming_the_field(capsys, overrides, needle):
    code = main(["plan", "model=tiny_moe", *overrides.split()])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Fix:" in err and "Traceback" not in err


def test_a_serving_plan_says_what_each_stage_holds(capsys):
    """mode=serve: per stage, bf16 weights of every expert (the router fp32), the KV caches of serve.max_batch x
    serve.max_context, and a MoE stage's work buffers; V3.2 in bf16 does not fit a pp8 stage on an H200 (exit 2, the
    table still printed), in FP8 it does (tests/test_fp8_plan.py)."""
    cfg = compose(["model=dsv32", "pipeline=pp8", "mode=serve", "serve.max_batch=64", "serve.max_context=32768"])
    plan = build_plan(cfg)
    m, e = cfg.model, cfg.model.moe
    for st, se in zip(plan.stages, plan.estimates["stages"]):
        terms = se["serve_memory_bytes"]
        router = se["moe_layers"] * e.n_routed_experts * (m.dim + 1)  # gate weight + selection bias, both fp32
        assert terms["weights"] == 2 * (se["params"] - router + se["moe_layers"] * e.n_routed_experts) + 4 * router
        kv = sum(E.kv_bytes_per_token(m, plan.layers[i].role) for i in st.layers)
        assert terms["KV and indexer-key caches"] == kv * 64 * 32769
        assert terms["MoE work buffers"] == 64 * 128 * 8 * (2 * 7168 + 4 * 2048) * 2  # prefill_chunk 128
    assert max(sum(se["serve_memory_bytes"].values()) for se in plan.estimates["stages"]) > 141e9
    assert main(["plan", "model=dsv32", "pipeline=pp8", "mode=serve"]) == 2
    out = capsys.readouterr().out
    assert "serving memory per stage" in out and "do not fit plan.device_memory_gib" in out
