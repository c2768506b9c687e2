"""Output paths never overwrite a run, a checkpoint or an input of the same command (dsaflow.outputs): the command
exits 2 with one paragraph, the target's bytes are unchanged and nothing else is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsaflow.cli import main
from dsaflow.errors import PlanError
from dsaflow.outputs import CHECKPOINT_MARKER, CONFIG, PLAN, check_output_dir, check_output_file
from dsaflow.rundir.folder import CONFIG as RUN_CONFIG
from dsaflow.rundir.folder import MANIFEST, METRICS
from dsaflow.rundir.folder import PLAN as RUN_PLAN


def fake_run(root: Path) -> Path:
    """A run dir's files as `dsaflow train` leaves them (contents irrelevant: they must only survive)."""
    run = root / "run"
    ckpt = run / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    for path, text in [
        (run / "config.yaml", "model: {}\n"),
        (run / "plan.json", "{}\n"),
        (run / "metrics.jsonl", '{"step": 1, "loss": 5.0}\n'),
        (ckpt / "manifest.json", '{"step": 2}\n'),
    ]:
        path.write_text(text)
    return run


def test_markers_agree_with_the_run_dir_and_checkpoint_writers():
    assert (PLAN, CONFIG, CHECKPOINT_MARKER) == (RUN_PLAN, RUN_CONFIG, MANIFEST)
    assert METRICS == "metrics.jsonl"


@pytest.mark.parametrize(
    "target",
    [
        "prompts",
        "run/metrics.jsonl",
        "run/config.yaml",
        "run/checkpoints/step-000002/manifest.json",
        "run/new.jsonl",
        "link-to-manifest",
        "gen/out.jsonl",
    ],
)
def test_generate_refuses_an_output_file_onto_a_run_or_an_input(tmp_path, monkeypatch, capsys, target):
    monkeypatch.chdir(tmp_path)
    run = fake_run(tmp_path)
    prompts = tmp_path / "prompts"
    prompts.write_text('{"prompt": "hi"}\n')
    os.symlink(run / "checkpoints" / "step-000002" / "manifest.json", tmp_path / "link-to-manifest")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc = main(
        [
            "generate",
            f"serve.prompts_file={prompts}",
            f"serve.output_file={tmp_path / target}",
            f"run_dir={tmp_path / 'gen'}",
            "serve.max_new_tokens=1",
            "track=none",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "serve.output_file=" in err and "Fix:" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing changed or added
    assert not (tmp_path / "gen").exists()


def test_an_output_folder_may_sit_in_a_run_dir_but_never_be_one_or_in_a_checkpoint(tmp_path):
    run = fake_run(tmp_path)
    ckpt = run / "checkpoints" / "step-000002"
    assert (
        check_output_dir("search.out_dir", run / "search", {"checkpoint": str(ckpt)}, in_run_ok=True)
        == (run / "search").resolve()
    )
    for bad in (run, run / "checkpoints", ckpt, ckpt / "search"):
        with pytest.raises(PlanError, match="search.out_dir"):
            check_output_dir("search.out_dir", bad, {"checkpoint": str(ckpt)}, in_run_ok=True)
    with pytest.raises(PlanError, match="an input of this command"):
        check_output_dir("out", tmp_path / "data" / "x", {"data.path": str(tmp_path / "data")})


def test_a_folder_with_only_a_config_yaml_is_not_a_run(tmp_path):
    """Plenty of projects keep a config.yaml at their root: writing next to it is the user's business."""
    (tmp_path / "config.yaml").write_text("a: 1\n")
    check_output_file("serve.output_file", str(tmp_path / "out.jsonl"))


def test_outputs_are_replaced_whole(tmp_path, monkeypatch):
    """write_outputs renames a complete file over the old one: a link at the target is replaced, not followed."""
    from dsaflow.serve.generate import write_outputs

    theirs = tmp_path / "theirs.txt"
    theirs.write_text("keep me\n")
    out = tmp_path / "out.jsonl"
    os.symlink(theirs, out)
    write_outputs(["a"], [[98]], str(out))
    assert theirs.read_text() == "keep me\n" and not out.is_symlink()
    assert json.loads(out.read_text())["completion"] == "b"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_weights_export_refuses_an_out_file_in_a_run(tmp_path, capsys):
    from dsaflow.checkpoint.weights import main as weights_main

    run = fake_run(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for out in (run / "weights.safetensors", run / "checkpoints" / "step-000002" / "manifest.json"):
        assert weights_main(["export", str(run), str(out)]) == 2
        assert "OUT=" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
