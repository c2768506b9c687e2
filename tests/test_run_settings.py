"""A run dir is the source of truth: resume, generate and search read its config.yaml and take from the command line
only what the user changes (dsaflow/config/from_run.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsaflow.config.compose import compose, to_yaml
from dsaflow.config.from_run import settings_from_run
from dsaflow.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _run(tmp_path, *overrides) -> Path:
    """A run dir as `dsaflow train` leaves it, as far as the settings go: its resolved config.yaml."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(compose(list(overrides))))
    return run


def test_resume_keeps_the_runs_pipeline_and_training_settings_and_takes_only_what_the_user_changes(tmp_path):
    run = _run(tmp_path, "pipeline=pp2", "train.ckpt_every=50", "train.steps=300", "index=every2", "track=none")
    given = ["train.resume=true", f"run_dir={run}", "train.steps=600"]
    cfg = settings_from_run(compose(given), given, "train")
    assert (cfg.pipeline.name, cfg.pipeline.stages) == ("pp2", 2)
    assert (cfg.train.ckpt_every, cfg.train.steps, cfg.train.resume) == (50, 600, True)
    assert (cfg.index.name, str(cfg.track.mode)) == ("every2", "disabled")
    again = ["train.resume=true", f"run_dir={run}", "pipeline=pp4"]  # a whole group given: the user's group
    assert settings_from_run(compose(again), again, "train").pipeline.stages == 4


def test_generate_and_search_take_the_model_and_layout_from_the_run_or_its_checkpoint_folder(tmp_path):
    run = _run(tmp_path, "index=every4", "index.promote=false", "model.num_layers=4", "data.num_pairs=3")
    folder = run / "checkpoints" / "step-000300"
    folder.mkdir(parents=True)
    for path in (run, folder):
        given = ["mode=serve", f"serve.checkpoint={path}"]
        cfg = settings_from_run(compose(given), given, "generate")
        assert (cfg.index.name, cfg.index.promote, cfg.model.num_layers) == ("every4", False, 4)
    from dsaflow.config.from_run import run_dir_of

    assert run_dir_of(str(folder)) == run and run_dir_of(str(run / "elsewhere" / "x")) is None  # only checkpoints/
    given = [f"search.checkpoint={run}", "pipeline=pp2"]
    cfg = settings_from_run(compose(given), given, "search")
    assert (cfg.model.num_layers, cfg.data.num_pairs, cfg.pipeline.stages, cfg.index.name) == (4, 3, 2, "all_full")


def test_a_model_other_than_the_runs_names_the_field_both_values_and_the_fix(tmp_path):
    run = _run(tmp_path)
    given = ["mode=serve", f"serve.checkpoint={run}", "model=small"]
    with pytest.raises(ConfigError) as err:
        settings_from_run(compose(given), given, "generate")
    text = str(err.value)
    assert "model=small" in text and "model=tiny" in text and "model.num_layers is 8 in the run, 12 as given" in text
    assert "Fix: drop model=small" in text
    small = _run(tmp_path / "s", "model=small")  # one field given: only that field is compared
    given = ["mode=serve", f"serve.checkpoint={small}", "model.num_layers=4"]
    with pytest.raises(
        ConfigError,
        match=r"^model.num_layers=4: .* model=small, .* model.num_layers is 12 in the run, "
        r"4 as given\. Fix",
    ):
        settings_from_run(compose(given), given, "generate")
    same = ["mode=serve", f"serve.checkpoint={run}", "model=tiny"]  # naming the run's own model is fine
    assert settings_from_run(compose(same), same, "generate").model.name == "tiny"


def test_generate_with_another_model_exits_2_naming_the_mismatch_not_missing_indexer_weights(tmp_path):
    run = _run(tmp_path, "index=every4", "track=none")
    res = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", "generate", f"serve.checkpoint={run}", "model=small"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "was trained with model=tiny" in res.stderr and "indexer weights" not in res.stderr


def test_plan_in_serve_mode_shows_the_runs_layout(tmp_path):
    run = _run(tmp_path, "index=every4", "track=none")
    res = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", "plan", "--format", "json", "mode=serve", f"serve.checkpoint={run}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    import json

    roles = "".join(layer["role"] for layer in json.loads(res.stdout)["layers"])
    assert roles == "FSSSFSSS"


@pytest.mark.slow
def test_the_printed_resume_command_works_as_pasted_and_keeps_the_runs_settings(tmp_path):
    """A pp2 run with train.ckpt_every=2 stops after step 2; `train.resume=true run_dir=RUN` alone continues it on
    two ranks, says where it resumed, prints the parameter header, and keeps train.ckpt_every."""
    run = tmp_path / "run"
    first = ["pipeline=pp2", "train.steps=4", "train.ckpt_every=2", "train.stop_at_step=2", "train.eval_every=0"]
    cli = [sys.executable, "-m", "dsaflow.cli", "train"]
    res = subprocess.run(
        [*cli, *first, "train.batch_size=4", "track=none", f"run_dir={run}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    res = subprocess.run(
        [*cli, "train.resume=true", f"run_dir={run}"], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed from step 2" in res.stdout and "parameters on 2 ranks" in res.stdout
    from dsaflow.config.compose import load_config

    cfg = load_config(run / "config.yaml")
    assert (cfg.pipeline.name, cfg.train.ckpt_every, cfg.train.batch_size, cfg.train.resume) == ("pp2", 2, 4, True)


def test_prepare_of_a_resume_keeps_the_runs_settings(tmp_path):
    """`python -m dsaflow.launch.launch prepare` (multi-node) reads a resumed run like `dsaflow train` does: it gets
    as far as the checkpoint check, past the stage comparison that a default pipeline would fail."""
    run = tmp_path / "run"
    for args in (["pipeline=pp2", "track=none", f"run_dir={run}"], ["train.resume=true", f"run_dir={run}"]):
        res = subprocess.run(
            [sys.executable, "-m", "dsaflow.launch.launch", "prepare", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=ENV,
            timeout=120,
        )
    assert res.returncode == 2 and "holds no complete checkpoint" in res.stderr, res.stderr
