"""The serving-memory view for FP8 weights: the FP8 policy by parameter name against a built model, DeepSeek-V3.2 on
eight H200s in FP8 (fits) and bf16 (exit 2, naming the weights and the fix), plan.device_memory_gib, bad values and the
pre-launch check on the same terms. (Serving with FP8 weights: tests/test_fp8_serve.py.)"""

from __future__ import annotations

import json
import math

import pytest

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.config.fp8_policy import FP8, FP32, SERVE_DTYPE, is_fp8_weight, weight_format
from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.errors import ResourceError
from dsaflow.launch import resources
from dsaflow.model import build_model
from dsaflow.plan import build_plan
from dsaflow.plan import estimates as E
from dsaflow.plan.plan import Plan
from dsaflow.plan.serve_memory import (
    KV,
    USABLE_FRACTION,
    WEIGHTS,
    WORK_BUFFERS,
    edge_weight_shapes,
    layer_weight_shapes,
    weight_bytes,
)

GiB = 2**30
# dims that are not multiples of 128 and span more than one block, so the scale grid's ceil() counts
ODD_MOE = ["model=tiny_moe", "model.dim=136", "model.moe.moe_inter_dim=72", "model.q_lora_rank=136"]
V32_PP8 = ["model=dsv32", "pipeline=pp8", "mode=serve"]


def _hand_count(model, weights: str, width: int = 2) -> int:
    """Bytes of a built model's state (parameters and persistent buffers) stored as `weights` says, counted tensor by
    tensor from the policy's rule by name: FP8 = 1 byte + one fp32 scale per 128x128 block of each matrix (a packed
    [E, rows, cols] tensor is E matrices), fp32 = 4, the rest `width`."""
    total = 0
    for name, t in model.state_dict().items():
        fmt = weight_format(name, weights)
        if fmt == FP8:
            *stack, rows, cols = t.shape
            total += t.numel() + math.prod(stack) * -(-rows // 128) * -(-cols // 128) * 4
        else:
            total += t.numel() * (4 if fmt == FP32 else width)
    return total


def _plan_json(capsys, *overrides):
    code = main(["plan", "format=json", *overrides])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_the_policy_names_the_released_checkpoints_fp8_tensors():
    fp8 = ["attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo", "attn.indexer.wq_b", "attn.indexer.wk"]
    fp8 += ["mlp.w1", "mlp.w3", "mlp.w2", "mlp.shared_experts.w1", "mlp.shared_experts.w2", "mlp.shared_experts.w3"]
    for suffix in fp8:
        assert is_fp8_weight(f"layers.7.{suffix}.weight") and weight_format(f"layers.7.{suffix}.weight") == FP8
    assert is_fp8_weight("layers.3.mlp.experts.gate_up_proj") and is_fp8_weight("layers.3.mlp.experts.down_proj")
    kept = ["embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight", "layers.0.attn.q_norm.weight"]
    kept += [
        "layers.0.attn.indexer.weights_proj.weight",
        "layers.0.attn.indexer.k_norm.bias",
        "layers.0.ffn_norm.weight",
    ]
    assert all(weight_format(n) == SERVE_DTYPE for n in kept)
    assert (
        weight_format("layers.3.mlp.gate.weight") == FP32 == weight_format("layers.3.mlp.gate.e_score_correction_bias")
    )
    assert weight_format("layers.7.attn.wo.weight", "bf16") == SERVE_DTYPE  # bf16: nothing is FP8
    with pytest.raises(ValueError, match="fp4"):
        weight_format("layers.7.attn.wo.weight", "fp4")


@pytest.mark.parametrize("overrides", [["model=tiny_moe"], ODD_MOE], ids=["tiny_moe", "odd_dims"])
def test_the_analytic_byte_count_equals_a_hand_count_over_the_built_model(overrides):
    m = compose(overrides).model
    roles = "FSFS" + "S" * (m.num_layers - 4)
    model = build_model(m, roles)
    moe = [is_moe_layer(m, i) for i in range(m.num_layers)]
    assert any(moe) and not all(moe)  # dense and MoE layers, F and S layers
    for i, layer in model.layers.items():  # the planner's shapes are the model's, name for name
        shapes = dict(layer_weight_shapes(m, roles[int(i)], moe[int(i)]))
        assert shapes == {k: tuple(t.shape) for k, t in layer.state_dict().items()}, f"layer {i}"
        params = sum(math.prod(s) for k, s in shapes.items() if not k.endswith("e_score_correction_bias"))
        assert params == E.layer_params(m, roles[int(i)], moe[int(i)])
    edges = dict(edge_weight_shapes(m, True, True))
    assert edges == {k: tuple(t.shape) for k, t in model.state_dict().items() if not k.startswith("layers.")}
    for weights in ("fp8", "bf16"):
        for width in (2, 4):
            analytic = weight_bytes(m, list(roles), moe, True, True, weights, width)
            assert analytic == _hand_count(model, weights, width), (weights, width)
    # the plan's serving view (one stage, a GPU: bf16) counts the same bytes
    cfg = compose([*overrides, "mode=serve", "serve.weights=fp8", f"layout={roles}"])
    se = build_plan(cfg).estimates["stages"][0]
    assert se["serve_weight_bytes"] == se["serve_memory_bytes"][WEIGHTS] == _hand_count(model, "fp8")


def test_deepseek_v32_pp8_fits_eight_h200s_in_fp8(capsys):
    code, plan, err = _plan_json(capsys, *V32_PP8, "serve.weights=fp8")
    assert code == 0, err
    est = plan["estimates"]
    stages = est["stages"]
    eight_moe = [s for s in stages if s["moe_layers"] == 8]
    assert eight_moe and all(85 * GiB < s["serve_weight_bytes"] < 87 * GiB for s in eight_moe)
    assert sum(s["serve_weight_bytes"] for s in stages) == pytest.approx(628 * GiB, rel=0.01)  # the FP8 checkpoint
    assert all(s["serve_kv_tokens_fit"] >= 32768 and s["serve_fits"] for s in stages)
    for s in eight_moe:  # 8 F layers: (512 + 64 latent + 128 indexer key) x 2 bytes each
        assert s["serve_kv_bytes_per_token"] == 8 * (512 + 64 + 128) * 2
    assert est["serve"]["weights"] == "fp8" and Plan.from_json(json.dumps(plan)).estimates["serve"]["ranks"]
    # a long-context deployment: 16 rows of 128K tokens fit each stage beside its FP8 weights
    code, _, err = _plan_json(capsys, *V32_PP8, "serve.weights=fp8", "serve.max_batch=16", "serve.max_context=131072")
    assert code == 0, err
    assert main(["plan", *V32_PP8, "serve.weights=fp8"]) == 0
    out = capsys.readouterr().out
    assert "serving memory per stage" in out and "KV tokens" in out and "85.9" in out


def test_deepseek_v32_pp8_in_bf16_exits_2_naming_the_weights_and_the_fix(capsys):
    code = main(["plan", *V32_PP8])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert "serving memory per stage" in out  # the numbers, then why they do not fit
    assert err.startswith("dsaflow: error: ") and "serve.weights=bf16" in err
    assert "The largest term is weights (171.7 GiB)" in err
    assert "Fix: serve.weights=fp8" in err and "that alone fits on these 8 stages" in err
    assert "pipeline.stages=13 is the fewest that fits" in err
    # the suggested stage count does fit
    assert main(["plan", *V32_PP8, "pipeline.stages=13"]) == 0
    capsys.readouterr()


def test_too_long_a_context_names_the_kv_caches_and_what_fits(capsys):
    code = main(["plan", *V32_PP8, "serve.weights=fp8", "serve.max_batch=64", "serve.max_context=131072"])
    err = capsys.readouterr().err
    assert code == 2 and "The largest term is KV and indexer-key caches" in err
    assert "a shorter serve.max_context or a smaller serve.max_batch" in err and "serve.max_batch=27)" in err


def test_device_memory_changes_the_kv_tokens_linearly():
    fits, kv = {}, None
    for gib in (80.0, 100.0, 120.0, 140.0):
        cfg = compose([*V32_PP8, "serve.weights=fp8", f"plan.device_memory_gib={gib}"])
        se = build_plan(cfg).estimates["stages"][3]
        kv = se["serve_kv_bytes_per_token"]
        free = USABLE_FRACTION * gib * GiB - se["serve_weight_bytes"] - se["serve_work_buffer_bytes"]
        assert se["serve_kv_tokens_fit"] == math.floor(free / kv)
        assert se["serve_work_buffer_bytes"] == sum(se["serve_memory_bytes"][k] for k in WORK_BUFFERS)
        fits[gib] = se["serve_kv_tokens_fit"]
    steps = [fits[b] - fits[a] for a, b in ((80.0, 100.0), (100.0, 120.0), (120.0, 140.0))]
    per_step = USABLE_FRACTION * 20 * GiB / kv
    assert all(abs(s - per_step) <= 1 for s in steps)
    assert fits[80.0] < 0  # 80 GiB cannot hold an 86 GiB stage: the plan says so (exit 2)
    assert main(["plan", *V32_PP8, "serve.weights=fp8", "plan.device_memory_gib=80"]) == 2


@pytest.mark.parametrize(
    "override, needle",
    [
        ("serve.weights=fp4", "serve.weights='fp4' is not a valid choice. Fix: use one of bf16, fp8."),
        ("plan.device_memory_gib=0", "plan.device_memory_gib=0 is out of range: allowed (0, 4096]"),
        ("plan.device_memory_gib=-80", "plan.device_memory_gib=-80 is out of range"),
        ("plan.device_memory_gib=14040", "plan.device_memory_gib=14040 is out of range"),
        ("plan.device_memory_gib=lots", "plan.device_memory_gib='lots'"),
        ("plan.device_gib=80", "unknown key plan.device_gib"),
    ],
)
def test_bad_values_exit_2_naming_the_field(capsys, override, needle):
    code = main(["plan", "mode=serve", override])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Fix:" in err and "Traceback" not in err


def test_the_prelaunch_check_uses_the_same_terms_with_serve_weights(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda device, ranks: (140.4 * GiB, "an H200"))
    for weights in ("bf16", "fp8"):
        cfg = compose([*V32_PP8, f"serve.weights={weights}"])
        plan = build_plan(cfg)
        for st, se in zip(plan.stages, plan.estimates["stages"]):
            assert resources.rank_memory(cfg, plan, st.rank, "cuda", "generate") == se["serve_memory_bytes"]
    resources.check_resources(cfg, plan, "cuda", "generate")  # fp8 fits
    bf16 = compose(V32_PP8)
    with pytest.raises(ResourceError) as err:
        resources.check_resources(bf16, build_plan(bf16), "cuda", "generate")
    msg = str(err.value)
    assert "largest consumer is weights" in msg and "serve.weights=fp8" in msg and "pipeline.stages=13" in msg


def test_a_stage_holds_the_logits_only_when_it_is_last():
    cfg = compose(["model=tiny_moe", "pipeline=pp2", "mode=serve"])
    plan = build_plan(cfg)
    for st, se in zip(plan.stages, plan.estimates["stages"]):
        terms = se["serve_memory_bytes"]
        assert terms["logits"] == (8 * 128 * cfg.model.vocab_size * 4 if st.index == 1 else 0)  # 8 rows x chunk 128
        kv = sum(E.kv_bytes_per_token(cfg.model, plan.layers[i].role) for i in st.layers)
        assert terms[KV] == kv * 8 * 513 and se["serve_kv_bytes_per_token"] == kv
