"""config.json of the wrong types, ranges and depths: every field goes through one typed reader, so each mistake
exits 2 with one paragraph naming the file, the key and the value (never a traceback, a hang, or a model planned
from a value transformers would refuse). A hypothesis fuzz feeds random types and depths to both readers."""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsaflow.checkpoint.hf_config import MAX_LAYERS, apply_hf_model, hf_model, read_config_json
from dsaflow.checkpoint.hf_weights import HFIndex
from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.errors import PlanError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DSV32, GLM52 = FIXTURES / "deepseek_v32", FIXTURES / "glm_52"
REPO = Path(__file__).resolve().parent.parent


def edited(tmp_path: Path, src: Path, **changes) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


DROP = object()
YARN_NO_FACTOR = {"type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
NESTED_BAD = {"rope_type": "yarn", "factor": "forty", "original_max_position_embeddings": 4096}

# (fixture, config.json changes, what the message must name besides config.json)
WRONG = [
    (DSV32, {"hidden_size": "32"}, ['hidden_size="32"', "an integer in [1, 65536]"]),
    (DSV32, {"hidden_size": 32.5}, ["hidden_size=32.5", "an integer"]),
    (DSV32, {"hidden_size": True}, ["hidden_size=true", "an integer"]),
    (DSV32, {"hidden_size": None}, ["has no hidden_size"]),
    (DSV32, {"hidden_size": 0}, ["hidden_size=0", "[1, 65536]"]),
    (DSV32, {"vocab_size": 1e30}, ["vocab_size=1e+30", "an integer"]),
    (DSV32, {"num_attention_heads": [128]}, ["num_attention_heads=[128]", "an integer"]),
    (DSV32, {"rms_norm_eps": "1e-6"}, ['rms_norm_eps="1e-6"', "a number in (0, 1)"]),
    (DSV32, {"rms_norm_eps": float("nan")}, ["rms_norm_eps=NaN", "a number"]),
    (DSV32, {"rope_theta": float("inf"), "rope_scaling": DROP}, ["rope_theta=Infinity", "a number"]),
    (DSV32, {"rope_parameters": "yarn"}, ['rope_parameters="yarn"', "a JSON object"]),
    (DSV32, {"rope_scaling": YARN_NO_FACTOR}, ["rope_scaling.factor is missing", "YaRN needs it"]),
    (DSV32, {"rope_scaling": NESTED_BAD}, ['rope_scaling.factor="forty"', "a number in [1, 1e+06]"]),
    (DSV32, {"rope_scaling": {"type": 7}}, ["rope_scaling.rope_type=7"]),
    (DSV32, {"quantization_config": "fp8"}, ['quantization_config="fp8"', "a JSON object"]),
    (DSV32, {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     ['quantization_config.fmt="e5m2"', "'e4m3'"]),
    (DSV32, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128.5, 128]}},
     ["quantization_config.weight_block_size=[128.5, 128]", "[128, 128]"]),
    (DSV32, {"tie_word_embeddings": "false"}, ['tie_word_embeddings="false"', "true or false"]),
    (DSV32, {"attention_bias": 0}, ["attention_bias=0", "true or false"]),
    (DSV32, {"norm_topk_prob": 1}, ["norm_topk_prob=1", "true or false"]),
    (DSV32, {"n_routed_experts": "256"}, ['n_routed_experts="256"', "an integer"]),
    (DSV32, {"routed_scaling_factor": True}, ["routed_scaling_factor=true", "a number"]),
    (DSV32, {"num_key_value_heads": 1.5}, ["num_key_value_heads=1.5", "an integer"]),
    (DSV32, {"num_nextn_predict_layers": "1"}, ['num_nextn_predict_layers="1"', "an integer"]),
    (DSV32, {"mlp_layer_types": ["dense", "banana"]}, ["mlp_layer_types", "a list of 61 entries", "'sparse'"]),
    (DSV32, {"mlp_layer_types": ["dense"] * 60 + [["sparse"]]}, ["mlp_layer_types", "61 entries"]),
    (DSV32, {"first_k_dense_replace": -1}, ["first_k_dense_replace=-1", "an integer in [0, inf]"]),
    (GLM52, {"index_topk_freq": "abc"}, ['index_topk_freq="abc"', "an integer in [1, 1024]"]),
    (GLM52, {"index_topk_freq": 0}, ["index_topk_freq=0", "[1, 1024]"]),
    (GLM52, {"index_skip_topk_offset": 2.5}, ["index_skip_topk_offset=2.5", "an integer"]),
    (GLM52, {"indexer_types": ["full", "half"] * 39}, ["indexer_types", "78 entries", "'shared'"]),
    (GLM52, {"indexer_types": "full"}, ['indexer_types="full"', "78 entries"]),
    (GLM52, {"index_topk_pattern": ["F", 1] * 39}, ["index_topk_pattern", "78 letters"]),
    (GLM52, {"index_topk_pattern": {"F": 1}}, ["index_topk_pattern", "78 letters"]),
    (GLM52, {"model_type": ["glm_moe_dsa"]}, ['model_type=["glm_moe_dsa"] is not a family']),
]  # fmt: skip


@pytest.mark.parametrize(
    "src, changes, needles", WRONG, ids=[f"{i}-{'-'.join(c)}" for i, (_, c, _) in enumerate(WRONG)]
)
def test_config_json_of_a_wrong_type_exits_2_naming_file_key_and_value(tmp_path, capsys, src, changes, needles):
    folder = edited(tmp_path, src, **changes)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["plan", "model=hf", f"model.hf_path={folder}"]) == 2
    err = capsys.readouterr().err
    assert str(folder / "config.json") in err and "Traceback" not in err and "Fix:" in err, err
    assert all(n in err for n in needles), err
    assert len(err.strip().splitlines()) == 1, err  # one paragraph
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_whole_floats_read_as_integers_and_yarn_factor_null_is_the_context_ratio(tmp_path):
    yarn = {"type": "yarn", "factor": None, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
    folder = edited(tmp_path, DSV32, hidden_size=7168.0, rope_scaling=yarn)
    hf = hf_model(read_config_json(folder))
    assert hf.model.dim == 7168 and type(hf.model.dim) is int
    assert hf.model.rope_scaling.factor == 163840 / 4096  # transformers' rule for a null factor


def test_yarn_without_original_positions_uses_max_position_embeddings_as_transformers_does(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0}
    folder = edited(tmp_path, DSV32, rope_scaling=DROP, rope_parameters=yarn)
    assert hf_model(read_config_json(folder)).model.rope_scaling.original_max_position_embeddings == 163840


def test_deeply_nested_or_huge_or_non_object_config_json_exits_2(tmp_path, capsys):
    cases = {
        "deep": '{"hidden_size": ' + "[" * 200_000 + "]" * 200_000 + "}",
        "list": "[1, 2, 3]",
        "huge-int": '{"hidden_size": ' + "9" * 5000 + "}",
        "big": '{"x": "' + "a" * (2 << 20) + '"}',
        "binary": b"\xff\xfe\x00{",
    }
    for name, text in cases.items():
        folder = tmp_path / name
        shutil.copytree(DSV32, folder)
        (folder / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        assert main(["plan", "model=hf", f"model.hf_path={folder}"]) == 2, name
        err = capsys.readouterr().err
        assert "config.json" in err and "Traceback" not in err and len(err) < 600, (name, err)


@pytest.mark.parametrize("layers", [1025, 1_000_000_000, 10**18])
def test_a_huge_layer_count_exits_2_at_once_on_both_paths(tmp_path, layers):
    """config.json's num_hidden_layers is bounded before any per-layer list is built (GLM's roles loop over the
    layers); the Hydra path is the schema's range. A subprocess, so that a regression shows as a timeout."""
    folder = edited(tmp_path, GLM52, num_hidden_layers=layers)
    for overrides in (["model=hf", f"model.hf_path={folder}"], [f"model.num_layers={layers}"]):
        cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "plan", *overrides]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr[-2000:]
        assert "Traceback" not in res.stderr and f"{layers}" in res.stderr and f"{MAX_LAYERS}" in res.stderr
        assert ("num_hidden_layers" if "model=hf" in overrides else "model.num_layers") in res.stderr


# --- fuzz ----------------------------------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)
CONFIGS = {
    "dsv32": json.loads((DSV32 / "config.json").read_text()),
    "glm": json.loads((GLM52 / "config.json").read_text()),
}
KEYS = sorted(set(CONFIGS["dsv32"]) | set(CONFIGS["glm"]) | {"rope_parameters", "indexer_types", "mlp_layer_types"})
NESTED = ["factor", "rope_type", "type", "beta_fast", "original_max_position_embeddings", "quant_method", "fmt"]


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.sampled_from(sorted(CONFIGS)),
    changes=st.dictionaries(st.sampled_from(KEYS), json_value, min_size=1, max_size=3),
    nested=st.dictionaries(st.sampled_from(NESTED), json_value, max_size=2),
)
def test_fuzzed_config_json_is_planned_or_refused_as_a_user_error(which, changes, nested):
    raw = json.loads(json.dumps(CONFIGS[which]))
    raw.update(changes)
    for section in ("rope_scaling", "rope_parameters", "quantization_config"):
        if isinstance(raw.get(section), dict):
            raw[section].update(nested)
    try:
        hf = hf_model(raw, "fuzz/config.json")
    except PlanError as exc:
        assert "fuzz/config.json" in str(exc) and "\n" not in str(exc)
        return
    assert 1 <= hf.model.num_layers <= MAX_LAYERS and len(hf.roles) == hf.model.num_layers
    assert all(type(getattr(hf.model, f)) is int for f in ("dim", "n_heads", "vocab_size", "num_layers"))


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(index=json_value, depth=st.integers(min_value=0, max_value=3000))
def test_fuzzed_index_json_is_read_or_refused_as_a_user_error(index, depth):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        text = json.dumps({"weight_map": index}) if depth < 2 else "[" * depth + "]" * depth
        (folder / "model.safetensors.index.json").write_text(text)
        try:
            found = HFIndex.read(folder)
        except PlanError as exc:
            assert "\n" not in str(exc)
            return
        assert all(p.parent == folder.resolve() or p.is_relative_to(folder) for p in found.where.values())


def test_a_good_hf_config_still_composes(tmp_path):
    cfg = compose(["model=hf", f"model.hf_path={DSV32}"], model_source=apply_hf_model)
    assert cfg.model.num_layers == 61 and cfg.model.moe.first_k_dense == 3
