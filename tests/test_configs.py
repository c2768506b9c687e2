"""Every YAML in configs/ composes into the typed schema and plans; schema violations fail at compose, by name."""

import shutil
from pathlib import Path

import pytest

from dsaflow.config.compose import compose, default_config_dir, load_config, to_yaml
from dsaflow.config.schema import DSAFlowConfig
from dsaflow.errors import ConfigError
from dsaflow.plan import build_plan

CONFIG_DIR = default_config_dir()
GROUP_FILES = sorted(p for p in CONFIG_DIR.glob("*/*.yaml"))
SERVE_ONLY_KINDS = {"decode", "prefill", "mixed"}


def test_config_dir_is_the_repo_configs_folder():
    assert (CONFIG_DIR / "config.yaml").is_file()
    assert {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()} >= {
        "model",
        "index",
        "pipeline",
        "graphs",
        "train",
        "data",
        "track",
    }


def test_root_config_composes_to_the_typed_schema():
    cfg = compose([])
    assert isinstance(cfg, DSAFlowConfig)
    assert (cfg.model.name, cfg.index.name, cfg.pipeline.name, cfg.graphs.name) == ("tiny", "all_full", "single", "off")
    build_plan(cfg)


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_group_option_composes_and_plans(path):
    group, option = path.parent.name, path.stem
    cfg = compose([f"{group}={option}"])
    if {b.kind for b in cfg.graphs.blocks} & SERVE_ONLY_KINDS:  # decode/prefill/mixed graphs exist only when serving
        cfg = compose([f"{group}={option}", "mode=serve"])
    node = getattr(cfg, group)
    assert node.name == option  # each file names itself, so run dirs and logs say which option was used
    plan = build_plan(cfg)
    assert plan.num_layers == cfg.model.num_layers


@pytest.mark.parametrize("model", ["dsv32", "glm47flash", "glm5", "small"])
@pytest.mark.parametrize("pipeline", ["pp2", "pp4", "pp8", "pp4_interleaved"])
def test_real_models_plan_under_every_pipeline(model, pipeline):
    cfg = compose([f"model={model}", "index=every4", f"pipeline={pipeline}"])
    plan = build_plan(cfg)
    assert plan.num_stages == cfg.pipeline.stages
    assert {l.role for l in plan.layers} == {"F", "S"}


def test_model_shapes_are_the_public_ones():
    v32 = compose(["model=dsv32"]).model
    assert (
        v32.num_layers,
        v32.dim,
        v32.n_heads,
        v32.q_lora_rank,
        v32.kv_lora_rank,
        v32.qk_rope_head_dim,
        v32.qk_nope_head_dim,
        v32.v_head_dim,
        v32.index_n_heads,
        v32.index_head_dim,
        v32.index_topk,
        v32.vocab_size,
    ) == (61, 7168, 128, 1536, 512, 64, 128, 128, 64, 128, 2048, 129280)
    assert compose(["model=glm47flash"]).model.num_layers == 47
    assert compose(["model=glm5"]).model.num_layers == 78


def test_freq4_f_layers_match_the_documented_list():
    plan = build_plan(compose(["model=dsv32", "index=every4"]))
    assert [l.index for l in plan.layers if l.role == "F"] == list(range(0, 61, 4))


def _copy_configs(tmp_path: Path) -> Path:
    dst = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, dst)
    return dst


def test_unknown_key_in_a_yaml_fails_at_compose_naming_it(tmp_path):
    cdir = _copy_configs(tmp_path)
    (cdir / "model" / "typo.yaml").write_text("name: typo\nnum_layer: 4\n")
    with pytest.raises(ConfigError) as e:
        compose(["model=typo"], config_dir=str(cdir))
    assert "num_layer" in str(e.value) and "num_layers" in str(e.value)  # names the key and lists the real fields


def test_wrong_type_in_a_yaml_fails_at_compose_naming_it(tmp_path):
    cdir = _copy_configs(tmp_path)
    (cdir / "model" / "wrongtype.yaml").write_text("name: wrongtype\ndim: wide\n")
    with pytest.raises(ConfigError) as e:
        compose(["model=wrongtype"], config_dir=str(cdir))
    assert "model.dim='wide'" in str(e.value) and "int" in str(e.value)


def test_env_var_selects_the_config_dir(tmp_path, monkeypatch):
    cdir = _copy_configs(tmp_path)
    (cdir / "model" / "mine.yaml").write_text("name: mine\nnum_layers: 3\n")
    monkeypatch.setenv("DSAFLOW_CONFIG_DIR", str(cdir))
    assert compose(["model=mine"]).model.num_layers == 3


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.foo=1"], "unknown key model.foo"),
        (["+model.foo=1"], "unknown key model.foo"),
        (["model.dim=abc"], "model.dim='abc'"),
        (["model=nope"], "Fix: use one of dsv32, glm47flash, glm5, glm52, hf, mid, small, small_moe, tiny, tiny_moe"),
        (["pipeline=pp3"], "no option 'pp3' in the config group 'pipeline'"),
        (["model.dim=[1"], "could not compose the config"),
        (["graphs.blocks=[{name:a,kind:layers,bogus:1}]"], "unknown key bogus"),
    ],
)
def test_compose_errors_are_one_paragraph(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert needle in str(e.value) and "Fix:" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_layout_values_need_no_hydra_quoting():
    cfg = compose(["layout=(FSSS)*2 | (FSSS)*2"])
    assert cfg.layout == "(FSSS)*2 | (FSSS)*2"
    assert compose(["layout='FS|FSSSSS'"]).layout == "FS|FSSSSS"


def test_to_yaml_and_load_config_round_trip(tmp_path):
    cfg = compose(
        [
            "model=small",
            "index=every2",
            "pipeline=pp2",
            "layout=null",
            "+extra.note=hello",
            "mode=serve",
            "graphs=decode",
        ]
    )
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    back = load_config(path)
    assert back == cfg
    assert build_plan(back) == build_plan(cfg)


def test_load_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  dimm: 3\n")
    with pytest.raises(ConfigError, match="model.dimm"):
        load_config(path)
