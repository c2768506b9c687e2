"""`model=hf model.hf_path=DIR`: config.json -> ModelConfig + MoE + layer roles, planned without reading a weight."""

import json
import shutil
from pathlib import Path

import pytest

from dsaflow.checkpoint.hf_config import apply_hf_model, hf_model, read_config_json
from dsaflow.cli import main
from dsaflow.config.compose import compose
from dsaflow.errors import ConfigError
from dsaflow.plan import build_plan

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DSV32, GLM52 = FIXTURES / "deepseek_v32", FIXTURES / "glm_52"


def hf_compose(folder, *overrides):
    return compose(["model=hf", f"model.hf_path={folder}", *overrides], model_source=apply_hf_model)


def test_deepseek_v32_plans_671b_parameters_on_pp8():
    cfg = hf_compose(DSV32, "pipeline=pp8")
    m = cfg.model
    assert (m.num_layers, m.dim, m.n_heads, m.index_topk, m.moe.n_routed_experts, m.moe.first_k_dense) == (
        61, 7168, 128, 2048, 256, 3,
    )  # fmt: skip
    assert (m.rope_scaling.factor, m.rope_scaling.original_max_position_embeddings) == (40, 4096)
    plan = build_plan(cfg)
    # DeepSeek-V3's 671.03B plus V3.2's 61 indexers (14.0M each), plus the MTP layer on the last stage: a MoE block
    # (256 experts x 3 x 7168 x 2048 = 11.27B, attention, shared expert, indexer: 11.52B), its embedding copy
    # (129280 x 7168 = 0.93B) and eh_proj (2 x 7168^2 = 0.10B); the published 685B also counts its lm_head copy
    assert cfg.model.mtp_layers == 1
    assert 684e9 <= plan.estimates["total"]["params"] < 685e9
    assert 12.5e9 < plan.estimates["stages"][-1]["mtp_params"] < 12.6e9
    assert plan.num_stages == 8 and cfg.index.promote


def test_glm52_plans_21_f_layers_with_stages_starting_on_f(capsys):
    cfg = hf_compose(GLM52, "pipeline=pp8")
    assert "planned with index.promote=false" in capsys.readouterr().err
    assert cfg.index.promote is False and cfg.index.pattern.count("F") == 21
    plan = build_plan(cfg)
    assert sum(1 for lp in plan.layers if lp.role == "F") == 21
    assert all(plan.layers[s.layers[0]].role == "F" for s in plan.stages)
    assert not any(lp.promoted for lp in plan.layers)


def test_transformers_reads_the_fixtures_to_the_same_roles_and_mlp_types():
    from transformers import AutoConfig

    for folder in (DSV32, GLM52):
        theirs = AutoConfig.from_pretrained(folder)
        ours = hf_model(read_config_json(folder))
        types = getattr(theirs, "indexer_types", None) or ["full"] * theirs.num_hidden_layers
        assert "".join("F" if t == "full" else "S" for t in types) == ours.roles
        dense = [i for i, t in enumerate(theirs.mlp_layer_types) if t == "dense"]
        assert dense == list(range(ours.model.moe.first_k_dense)) == [0, 1, 2]


def test_dsaflow_plan_cli_plans_the_hf_model(capsys):
    # training a pp8 stage of GLM-5.2 needs about a TiB: plan it on a device that holds it (else exit 2, after the table)
    assert main(["plan", "model=hf", f"model.hf_path={GLM52}", "pipeline=pp8", "plan.device_memory_gib=4096"]) == 0
    out = capsys.readouterr().out
    assert "model=hf: 78 layers" in out


def _edited(tmp_path, src, **changes):
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"model_type": "llama"}, 'model_type="llama" is not a family dsaflow reads'),
        ({"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
        ({"fancy_new_knob": 3}, "fancy_new_knob=3 is not supported"),
        ({"rope_scaling": {"type": "llama3", "factor": 8}}, 'rope_type="llama3" is not supported'),
    ],
)
def test_unsupported_config_json_exits_2_naming_the_field(tmp_path, capsys, changes, needle):
    folder = _edited(tmp_path, DSV32, **changes)
    assert main(["plan", "model=hf", f"model.hf_path={folder}"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "config.json" in err and "Traceback" not in err


def test_overrides_that_contradict_config_json_are_refused():
    with pytest.raises(ConfigError, match="model.dim=128 conflicts"):
        hf_compose(DSV32, "model.dim=128")
    assert hf_compose(DSV32, "model.index_topk=512").model.index_topk == 512  # a serving knob, not the architecture
    with pytest.raises(ConfigError, match="index.pattern / index.freq / layout"):
        hf_compose(GLM52, "index=every4")
    with pytest.raises(ConfigError, match="model=hf needs model.hf_path"):
        compose(["model=hf"], model_source=apply_hf_model)


def test_planning_an_hf_model_reads_no_weight_and_imports_no_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from dsaflow.cli import main; "
        f"rc = main(['plan', 'model=hf', 'model.hf_path={GLM52}', 'pipeline=pp8', 'plan.device_memory_gib=4096']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH 0", r.stdout + r.stderr


@pytest.mark.parametrize("model", [[], ["model=tiny"], ["model=tiny_moe"], ["model=hf", "model.name=mine"]])
def test_hf_path_without_model_hf_is_refused_naming_the_fix(tmp_path, capsys, model):
    """model.hf_path under another model would compute the checkpoint's model while the run says another."""
    assert main(["plan", *model, f"model.hf_path={DSV32}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"model.hf_path={DSV32} is set with model.name=" in err and "Fix: add model=hf" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
