"""Weights in from Hugging Face checkpoints: FP8 copies within dequantization rounding of bf16, the MTP layer
skipped, each rank reading only its stages' tensors, and every bad input refused (exit 2) with nothing loaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsaflow.checkpoint.hf_config import hf_model, read_config_json
from dsaflow.checkpoint.hf_weights import load_hf_weights
from dsaflow.errors import PlanError
from dsaflow.model import build_model
from dsaflow.model.stage import StageModule
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")
save_checkpoint = HF.save_checkpoint
write_fp8_copy = HF.write_fp8_copy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return save_checkpoint("deepseek_v32", tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module")
def fp8(bf16, tmp_path_factory):
    return write_fp8_copy(bf16, tmp_path_factory.mktemp("fp8") / "ckpt")


def loaded(folder, report=None):
    hf = hf_model(read_config_json(folder))
    model = build_model(hf.model, roles=hf.roles).float().eval()
    nbytes = load_hf_weights({0: model}, folder, hf.model, report=report or (lambda m: None))
    return hf, model, nbytes


def test_fp8_copy_loads_within_dequantization_rounding_of_bf16(bf16, fp8):
    lines = []
    hf, exact, _ = loaded(bf16)
    _, rounded, nbytes = loaded(fp8, lines.append)
    assert len(lines) == 1 and "multi-token-prediction layer(s) [3]" in lines[0]
    quantized = 0
    for (key, a), (_, b) in zip(exact.state_dict().items(), rounded.state_dict().items()):
        if a.dim() == 3 or (a.dim() == 2 and not key.endswith(("embed.weight", "head.weight", "gate.weight"))):
            if not key.endswith("weights_proj.weight"):
                # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; below 2^-6 (subnormals) the step is
                # 2^-9 of the block scale (amax / 448 <= max|w| / 448)
                bound = a.abs() / 16 + a.abs().max() / 448 * 2**-9 + 1e-7
                assert ((a - b).abs() <= bound).all(), key
                assert not torch.equal(a, b), key
                quantized += 1
                continue
        assert torch.equal(a, b), key  # kept in bf16 / fp32 by the checkpoint
    assert quantized > 10
    # (logits are not compared: a rounding can flip a top-k key or a routed expert, a discontinuous change)
    assert nbytes < sum(os.path.getsize(p) for p in Path(fp8).glob("*.safetensors"))  # the MTP layer is not read


def test_each_rank_reads_only_its_stages_tensors(bf16):
    hf = hf_model(read_config_json(bf16))
    from dsaflow.model import LayerSpec

    last = StageModule(hf.model, [LayerSpec(2, "F", 2)], is_first=False, is_last=True)
    first = StageModule(hf.model, [LayerSpec(0, "F", 0), LayerSpec(1, "F", 1)], is_first=True, is_last=False)
    n_last = load_hf_weights({1: last}, bf16, hf.model)
    n_first = load_hf_weights({0: first}, bf16, hf.model)
    _, _, n_all = loaded(bf16)
    assert n_first + n_last == n_all and 0 < n_last < n_all
    ref = loaded(bf16)[1].state_dict()
    for k, v in last.state_dict().items():
        assert torch.equal(v, ref[k]), k


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _weight_map(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def _set_weight_map(folder, wm):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def break_missing_shard(folder):
    shard = sorted(set(_weight_map(folder).values()))[-1]
    (folder / shard).unlink()
    return [shard, "tensor model."]


def break_missing_tensor(folder):
    wm = _weight_map(folder)
    del wm["model.layers.1.mlp.experts.3.up_proj.weight"]
    _set_weight_map(folder, wm)
    return ["model.safetensors.index.json", "model.layers.1.mlp.experts.3.up_proj.weight"]


def break_shape(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["intermediate_size"] = 40
    (folder / "config.json").write_text(json.dumps(raw))
    return [".safetensors", "model.layers.0.mlp.gate_proj.weight", "[40, 32]"]


def break_truncated(folder):
    shard = folder / _weight_map(folder)["model.layers.2.self_attn.o_proj.weight"]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 64)
    return [shard.name, "tensor model."]


def break_fp8_scale(folder):
    wm = _weight_map(folder)
    del wm["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    _set_weight_map(folder, wm)
    return [".safetensors", "model.layers.1.self_attn.q_b_proj.weight_scale_inv"]


def break_model_type(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["model_type"] = "mixtral"
    (folder / "config.json").write_text(json.dumps(raw))
    return ["config.json", 'model_type="mixtral"']


def break_outside(folder):
    """The index names a shard by absolute path outside the folder (a good copy of the shard lives there)."""
    wm = _weight_map(folder)
    shard = wm["model.layers.2.self_attn.o_proj.weight"]
    outside = folder.parent / "outside"
    outside.mkdir()
    os.replace(folder / shard, outside / shard)
    _set_weight_map(folder, {k: str(outside / v) if v == shard else v for k, v in wm.items()})
    return ["model.safetensors.index.json", "not a file name relative to the checkpoint folder"]


def break_nan_scale(folder):
    from safetensors.torch import save_file

    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    shard = folder / _weight_map(folder)[name]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return [shard.name, name, "holds nan", "finite and positive"]


BREAKS = [
    break_missing_shard,
    break_missing_tensor,
    break_shape,
    break_truncated,
    break_fp8_scale,
    break_model_type,
    break_outside,
    break_nan_scale,
]


@pytest.mark.parametrize("damage", BREAKS, ids=lambda f: f.__name__[6:])
def test_bad_checkpoint_is_refused_naming_file_and_tensor_with_nothing_loaded(fp8, tmp_path, damage):
    folder = _copy(fp8, tmp_path / "bad")
    needle = damage(folder)
    try:  # the model config.json describes (the shape break changes it), else the good one
        hf = hf_model(read_config_json(folder))
    except PlanError:
        hf = hf_model(read_config_json(fp8))
    model = build_model(hf.model, roles=hf.roles)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError) as e:  # CheckpointError, or ConfigError for config.json itself
        load_hf_weights({0: model}, folder, hf.model, report=lambda m: None)
    assert all(n in str(e.value) for n in needle) and "Fix:" in str(e.value), str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    [break_truncated, break_model_type, break_outside, break_nan_scale],
    ids=["truncated", "model_type", "outside", "nan_scale"],
)
def test_generate_exits_2_on_a_bad_checkpoint_before_any_worker(fp8, tmp_path, damage):
    folder = _copy(fp8, tmp_path / "bad")
    needle = damage(folder)
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "generate", "model=hf"]
    cmd += [f"model.hf_path={folder}", "serve.prompts=[abc]", "track=none", f"run_dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert all(n in res.stderr for n in needle) and "Traceback" not in res.stderr


def test_train_exits_2_on_a_bad_checkpoint_before_any_worker(fp8, tmp_path):
    """The same header check as generate's runs before `dsaflow train` starts a worker."""
    folder = _copy(fp8, tmp_path / "bad")
    needle = break_nan_scale(folder)
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "train", "model=hf", "train.steps=1"]
    cmd += [f"model.hf_path={folder}", "track=none", f"run_dir={run}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert all(n in res.stderr for n in needle) and "Traceback" not in res.stderr
    assert not run.exists()  # nothing written


def test_fp8_tensors_are_e4m3_with_block_scales(fp8):
    wm = _weight_map(fp8)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    with safe_open(str(fp8 / wm[name]), "pt") as f:
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
    with safe_open(str(fp8 / wm[name + "_scale_inv"]), "pt") as f:
        assert f.get_tensor(name + "_scale_inv").shape == (1, 1)


def test_the_tiny_checkpoint_script_writes_both_copies(tmp_path):
    assert HF.main(["--family", "deepseek_v32", "--out", str(tmp_path / "bf16"), "--fp8", str(tmp_path / "fp8")]) == 0
    for folder in ("bf16", "fp8"):
        for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
            assert (tmp_path / folder / name).is_file(), (folder, name)
    assert loaded(tmp_path / "fp8")[2] > 0
