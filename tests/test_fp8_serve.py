"""Serving with FP8 weights (serve.weights=fp8) on CPU, where the FP8 GEMMs run their fp32 references:

- one FP8 projection against its fp32 weights within the bound e4m3 rounding gives (below), a converted stage's
  logits against the unconverted stage's on the same weights;
- a trained tiny_moe: greedy tokens with FP8 weights equal the fp32 weights' wherever the fp32 top-1 margin exceeds
  what FP8 moves the logits by, and a typical position's logits move by less than one e4m3 rounding (2^-4);
- an FP8 Hugging Face checkpoint keeps its e4m3 bytes and scales as stored, and `dsaflow generate` serves it;
- the planner's weight bytes equal the converted modules' bytes;
- an FP8 checkpoint whose packed experts cannot keep their stored scales exits 2, naming the tensor.

The bound. e4m3 keeps 3 mantissa bits: a value v rounded after scaling by its block's s (amax / 448) is off by at
most 2^-4 |v| (half a unit in the last place) in the normal range, and by at most 2^-10 s among the subnormals
(spacing 2^-9 s). With ex, ew those per-element bounds for x and w, |y - x.w| <= sum_k |ex_k| |w_k| + |x_k| |ew_k| +
|ex_k| |ew_k|, which the first test checks elementwise (plus fp32 summation slack).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import random

import pytest
import torch
from test_moe_serve import MOE_MODEL
from test_serve_pipelined import SERVE, shared_checkpoint, workload

from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.model.fp8_weights import FP8, FP8Linear, quantize_stage_
from dsaflow.ops.fp8_gemm import quantize_rows_1x128
from dsaflow.pipeline.stages import build_stages
from dsaflow.plan import build_plan
from dsaflow.plan.serve_memory import weight_bytes
from dsaflow.serve.generate import build_engine, build_stage_modules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("hf_tiny", os.path.join(REPO, "scripts", "hf_tiny_checkpoint.py"))
HF = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(HF)


def rounding_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most e4m3 rounding moves v (scale: its block's scale, broadcast to v's shape)."""
    return torch.maximum(v.abs() * 2.0**-4, scale * 2.0**-10)


def test_an_fp8_projection_is_within_the_e4m3_rounding_bound():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(300, 200, bias=False)  # partial blocks on both edges
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 300, generator=g) * torch.logspace(-3, 0, 300))  # wide dynamic range
    x = torch.randn(7, 300, generator=g) * 3
    fp8 = FP8Linear.from_linear(lin)
    y, ref = fp8(x), x @ lin.weight.detach().t()
    s_w = fp8.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    _, s_x = quantize_rows_1x128(x)
    ew, ex = rounding_bound(lin.weight.detach(), s_w), rounding_bound(x, s_x.repeat_interleave(128, 1)[:, :300])
    w = lin.weight.detach().abs()
    bound = ex @ w.t() + x.abs() @ ew.t() + ex @ ew.t()
    slack = 1e-5 * (x.abs() @ w.t())
    assert ((y - ref).abs() <= bound + slack).all()
    assert (y - ref).abs().max() > 0  # it did round


def test_a_moved_fp8_module_keeps_its_bytes():
    lin = torch.nn.Linear(64, 256, bias=False)
    fp8 = FP8Linear.from_linear(lin)
    w8, s = fp8.weight.clone(), fp8.weight_scale_inv.clone()
    fp8.to(torch.bfloat16)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale_inv.dtype == torch.float32
    assert torch.equal(fp8.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(fp8.weight_scale_inv, s)


PASSAGE_BYTES = 256  # the text the prompts are cut from (tests/test_fp8_serve_gpu.py trains on it by heart)


def passage() -> bytes:
    """The first PASSAGE_BYTES of docs/training.md, as ASCII."""
    return bytes(b if b < 128 else 32 for b in open(os.path.join(REPO, "docs", "training.md"), "rb").read())[
        :PASSAGE_BYTES
    ]


def passage_prompts(n: int = 32, seed: int = 1) -> list:
    """n prompts of 16 to 48 bytes cut from the passage at seeded random places."""
    rng = random.Random(seed)
    text = passage()
    starts = [(rng.randint(16, 48), rng.random()) for _ in range(n)]
    return [list(text[int(u * (len(text) - k)) :][:k]) for k, u in starts]


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    """tiny_moe trained briefly on a doc (the checkpoint test_moe_serve.py serves, made once per session)."""
    return shared_checkpoint(tmp_path_factory, "model=tiny_moe")


def _serve_cfg(run, weights, pipeline="single"):
    return compose(
        [
            "mode=serve",
            f"pipeline={pipeline}",
            *MOE_MODEL,
            *SERVE,
            f"serve.checkpoint={run}",
            f"serve.weights={weights}",
        ]
    )


def _stage(run, weights):
    cfg = _serve_cfg(run, weights)
    return build_stage_modules(cfg, build_plan(cfg), None, "cpu", torch.float32)[0]


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1)


def test_a_converted_stage_matches_the_unconverted_one(trained_moe):
    ref, fp8 = _stage(trained_moe, "bf16"), _stage(trained_moe, "fp8")
    assert fp8.layers["1"].attn.wo.weight.dtype == FP8 and fp8.layers["1"].mlp.experts.gate_up_proj.dtype == FP8
    prompts, _ = workload(8, seed=3)
    x = torch.tensor([p[:8] for p in prompts if len(p) >= 8][:4])
    with torch.no_grad():
        a, b = ref(x), fp8(x)
    cos = _cosines(a, b)
    # 7 MoE layers of activations and weights each within 2^-4 relative: the logits move by a few percent
    rel = ((a - b).abs().amax() / a.abs().amax()).item()
    assert cos.min() > 0.99 and rel < 0.1, (cos.min().item(), rel)


# Per generated position, ||fp8 logits - fp32 logits|| / ||fp32 logits|| for the median position. e4m3 moves each
# weight and activation by at most 2^-4 of itself (half a unit in the last of 3 mantissa bits); rounding errors
# that are independent across the K terms of a dot product leave its result off by an RMS of at most
# sqrt(2) * 2^-4 / sqrt(3) ~= 0.05 of the terms' scale (two operands, each uniform within +-2^-4 relative), and
# the residual stream carries each layer's FP8 branch next to its exact input, so the logits of a typical position
# move by less than one rounding, 2^-4. The median leaves out the few positions where a rounding flips a discrete
# choice (a MoE layer's experts, the indexer's top-k keys), which moves the logits by more than any rounding bound
# and depends on the model's weights, not on the arithmetic. A wrong scale or layout moves them by 1 or more.
FP8_MEDIAN_RELATIVE_LOGIT_ERROR = 2.0**-4
# The engines' logits and the stages' (used for the margins and errors below) are the same fp32 arithmetic in
# another order (cached decode, chunked prefill): they differ by about sqrt(n) * 2^-24 per reduction of n terms,
# far below 1e-4 of the largest logit over the few dozen reductions on a token's path.
REORDER_SLACK = 1e-4


def test_greedy_tokens_with_fp8_weights_equal_full_precision(trained_moe):
    """32 prompts, 8 new tokens each, served by the engine with FP8 weights and with fp32 weights. Where the two
    first differ (position j, same context before it) the fp32 logits la and the FP8 logits lb of that context
    must have a near-tie: FP8 picked b != a = argmax la, so la[a] - la[b] <= (la[a] - lb[a]) + (lb[b] - la[b]) <=
    2 max|la - lb| (plus REORDER_SLACK for the engine's fp32 order). Everywhere else the tokens must agree, which
    this checks without a threshold on how many: that count depends on how confident the trained model is. What
    FP8 does to the logits is bounded separately (FP8_MEDIAN_RELATIVE_LOGIT_ERROR)."""
    prompts = passage_prompts()
    limits = [8] * len(prompts)
    runs = {}
    for weights in ("bf16", "fp8"):
        cfg = _serve_cfg(trained_moe, weights)
        eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
        eng.capture()
        runs[weights] = eng.generate(prompts, limits)
    ref, fp8 = _stage(trained_moe, "bf16"), _stage(trained_moe, "fp8")

    def logits(seen: torch.Tensor, start: int):  # the fp32 continuation: logits of every generated position at once
        return ref(seen)[0, start:-1], fp8(seen)[0, start:-1]

    assert_greedy_follows(prompts, runs["bf16"], runs["fp8"], logits, FP8_MEDIAN_RELATIVE_LOGIT_ERROR, "FP8 weights")


def assert_greedy_follows(prompts, exact_runs, approx_runs, logits, median_bound: float, what: str) -> None:
    """Greedy tokens of an approximation (approx_runs) against the exact ones, per prompt: where the two first differ
    (position j, same context before it), the exact logits la and the approximate logits lb of that context must
    have a near-tie, la[a] - la[b] <= 2 max|la - lb| (+ REORDER_SLACK for the engine's fp32 order); elsewhere the
    tokens agree. The median relative logit error over every generated position lies in (0, median_bound).
    logits(seen [1, T], start) -> (la, lb), each [T - 1 - start, vocab]: the logits that predicted seen[start + 1:]."""
    same, rel, ties = 0, [], []
    with torch.no_grad():
        for p, a, b in zip(prompts, exact_runs, approx_runs):
            la, lb = logits(torch.tensor([p + a]), len(p) - 1)
            rel.append((la - lb).norm(dim=-1) / la.norm(dim=-1))
            j = next((i for i in range(len(a)) if a[i] != b[i]), len(a))
            if j == len(a):
                same += 1
                continue
            margin, error = (la[j, a[j]] - la[j, b[j]]).item(), (la[j] - lb[j]).abs().max().item()
            ties.append((margin, error, REORDER_SLACK * la[j].abs().max().item()))
    rel = torch.cat(rel)
    msg = (
        f"{what}: {same} of {len(prompts)} prompts' greedy tokens equal; relative logit error median "
        f"{rel.median():.5f}, max {rel.max():.5f}; at each first difference (exact top-2 margin, max logit error): "
        + ", ".join(f"({m:.3f}, {e:.3f})" for m, e, _ in ties)
    )
    print(msg)
    assert all(m <= 2 * e + slack for m, e, slack in ties), msg
    assert 0 < rel.median() < median_bound, msg


def test_fp8_serving_runs_through_pp2_with_gloo(trained_moe, tmp_path):
    run = tmp_path / "run"
    args = ["generate", "pipeline=pp2", *MOE_MODEL, *SERVE, f"serve.checkpoint={trained_moe}", "serve.weights=fp8"]
    assert main([*args, "serve.prompts=[the model]", f"run_dir={run}"]) == 0


def test_planner_weight_bytes_equal_the_converted_modules_bytes():
    cfg = compose(["mode=serve", *MOE_MODEL, "serve.weights=fp8"])
    plan = build_plan(cfg)
    for stage in build_stages(cfg.model, plan):
        quantize_stage_(stage, "cpu", torch.float32)
        held = {t.data_ptr(): t.numel() * t.element_size() for t in stage.state_dict().values()}  # tied once
        ids = [int(k) for k in stage.layers]
        roles = [layer.attn.role for layer in stage.layers.values()]
        moe = [is_moe_layer(cfg.model, i) for i in ids]
        assert weight_bytes(cfg.model, roles, moe, stage.is_first, stage.is_last, "fp8", 4) == sum(held.values())


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny DeepSeek-V3.2 checkpoint with 128-wide experts and its FP8 copy -> (bf16 folder, fp8 folder)."""
    root = tmp_path_factory.mktemp("hf128")
    bf16 = HF.save_checkpoint("deepseek_v32", root / "bf16", moe_intermediate_size=128)
    HF.save_tokenizer(bf16)
    return bf16, HF.write_fp8_copy(bf16, root / "fp8")


def _hf_cfg(folder, weights="fp8"):
    from dsaflow.checkpoint.hf_config import apply_hf_model

    overrides = ["model=hf", f"model.hf_path={folder}", "mode=serve", f"serve.weights={weights}", "track=none"]
    return compose(overrides, model_source=apply_hf_model)


def test_an_fp8_checkpoint_keeps_its_e4m3_bytes_and_scales(hf_pair):
    import json

    from safetensors import safe_open

    folder = hf_pair[1]
    cfg = _hf_cfg(folder)
    sd = build_stage_modules(cfg, build_plan(cfg), None, "cpu", torch.float32)[0].state_dict()
    where = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]

    def stored(name):
        with safe_open(str(folder / where[name]), "pt") as f:
            return f.get_tensor(name)

    p = "model.layers.1."
    pairs = {
        "layers.1.attn.wo.weight": p + "self_attn.o_proj.weight",
        "layers.1.attn.wkv_b.weight": p + "self_attn.kv_b_proj.weight",
        "layers.1.mlp.shared_experts.w2.weight": p + "mlp.shared_experts.down_proj.weight",
    }
    for ours, theirs in pairs.items():
        assert sd[ours].dtype == stored(theirs).dtype == FP8
        assert torch.equal(sd[ours].view(torch.uint8), stored(theirs).view(torch.uint8)), ours
        assert torch.equal(sd[ours + "_scale_inv"], stored(theirs + "_scale_inv")), ours
    for e in (0, 5):
        gate, up, down = (stored(f"{p}mlp.experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down"))
        gate_up = torch.cat([gate, up]).view(torch.uint8)
        assert torch.equal(sd["layers.1.mlp.experts.gate_up_proj"][e].view(torch.uint8), gate_up)
        assert torch.equal(sd["layers.1.mlp.experts.down_proj"][e].view(torch.uint8), down.view(torch.uint8))
        scales = torch.cat([stored(f"{p}mlp.experts.{e}.{w}_proj.weight_scale_inv") for w in ("gate", "up")])
        assert torch.equal(sd["layers.1.mlp.experts.gate_up_proj_scale_inv"][e], scales)


def test_generate_serves_an_fp8_checkpoint_with_fp8_weights(hf_pair, tmp_path, capfd):
    args = ["generate", "model=hf", f"model.hf_path={hf_pair[1]}", "serve.weights=fp8", "serve.prompts=[the quick]"]
    args += ["serve.max_new_tokens=6", "serve.max_context=64", "serve.prefill_chunk=8", "serve.max_batch=2"]
    assert main([*args, "track=none", f"run_dir={tmp_path / 'run'}"]) == 0
    assert "--- [0] 'the quick'" in capfd.readouterr().out


def test_bf16_checkpoint_quantizes_at_load_to_the_fp8_copys_values(hf_pair):
    """The bf16 checkpoint quantized at load and its FP8 copy (quantized by the script) hold the same weights up to
    one e4m3 step: the two quantizers compute amax / 448 the same way but round by a division vs a reciprocal."""
    built = []
    for folder in hf_pair:
        cfg = _hf_cfg(folder)
        built.append(build_stage_modules(cfg, build_plan(cfg), None, "cpu", torch.float32)[0].state_dict())
    a, b = built
    for key in ("layers.1.attn.wq_b.weight", "layers.2.mlp.experts.gate_up_proj"):
        assert a[key].dtype == b[key].dtype == FP8
        assert torch.allclose(a[key + "_scale_inv"], b[key + "_scale_inv"], rtol=1e-6)
        assert (a[key].float() - b[key].float()).abs().max() <= 32  # one step at the top of e4m3's range


def test_fp8_checkpoint_whose_experts_cannot_keep_their_scales_exits_2(tmp_path, capfd):
    bf16 = HF.save_checkpoint("deepseek_v32", tmp_path / "bf16")  # moe_intermediate_size 16: gate and up share a block
    HF.save_tokenizer(bf16)
    fp8 = HF.write_fp8_copy(bf16, tmp_path / "fp8")
    args = ["generate", "model=hf", f"model.hf_path={fp8}", "serve.weights=fp8", "serve.prompts=[the]"]
    assert main([*args, "serve.max_new_tokens=2", "track=none", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capfd.readouterr().err
    assert "layers.1.mlp.experts.gate_up_proj" in err and "Fix: serve.weights=bf16" in err and "Traceback" not in err


def test_a_converted_copy_leaves_the_original_alone():
    cfg = compose(["mode=serve", *MOE_MODEL])
    stage = build_stages(cfg.model, build_plan(cfg))[0]
    before = copy.deepcopy(stage.state_dict())
    quantize_stage_(copy.deepcopy(stage), "cpu", torch.float32)
    assert all(torch.equal(before[k], v) for k, v in stage.state_dict().items())


def test_the_stage_benchmark_runs_small_on_cpu(tmp_path):
    import json

    from script_helpers import load_script

    argv = ["stage", "--device", "cpu", "--model", "tiny_moe", "--first-layer", "1", "--layers", "2"]
    argv += ["--prefill", "64", "--decode-rows", "2", "--decode-context", "32", "--chunk", "32", "--reps", "1"]
    assert load_script("bench_serve").main([*argv, "--kernels", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_serve_stage.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["prefill", "decode"] and all(r["tokens_per_s"] > 0 for r in rows)
    top = rows[1]["kernels"]  # on CPU the aten ops of the pass, most expensive first
    assert "kernels" not in rows[0] and 1 <= len(top) <= 4 and all(k["calls"] >= 1 for k in top)
    assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True) and top[0]["ms"] > 0
    assert "Top kernels of the 2-row decode pass" in (tmp_path / "bench_serve_stage.md").read_text()
    families = {"attention projections", "indexer projections", "shared expert", "routed experts"}
    assert set(rows[0]["gemms"]) == families | {"all GEMMs of the layer"}
    assert all(rows[0]["gemms"][f]["tflops"] > 0 for f in families | {"all GEMMs of the layer"})
