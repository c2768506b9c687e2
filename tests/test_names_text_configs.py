"""Names that become paths stay in their folder, tracker fields follow wandb's rules, interpolations are resolved
once (in the parent), and text and numbers are checked before use: each exits 2 with one paragraph and writes
nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsaflow.cli import main
from dsaflow.config.compose import compose, load_config, to_yaml
from dsaflow.errors import ServeError
from dsaflow.serve.checks import fit_problem
from dsaflow.serve.prompts import load_requests


def files_under(root: Path) -> set:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.mark.parametrize(
    "override",
    [
        "track.run_name=x/../../../outside",
        "track.run_name=..",
        "model.name=a\\b",
        "data.name=" + "d" * 101,
        "track.run_name=tab\there",
        "track.project=" + "p" * 129,
        "track.project=a:b",
        "track.entity=me#you",
        "track.group=" + "g" * 129,
        "track.tags=[" + "t" * 65 + "]",
    ],
)
def test_names_and_tracker_fields_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, override):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    rc = main(["train", override, "train.steps=1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    field = override.split("=", 1)[0].replace("tags", "tags[0]")
    assert f"{field}=" in err and "Fix:" in err and "Traceback" not in err and len(err) < 600
    assert files_under(tmp_path) == {Path("a"), Path("a/b")}  # no runs/, nothing outside it


def test_an_escaped_interpolation_stays_text_in_the_run_dir_and_in_the_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAFLOW_TEST_SECRET", "hunter2")
    cfg = compose(["track=none", r"track.run_name=\${oc.env:DSAFLOW_TEST_SECRET}", "+extra.k=[a\\${b}]"])
    assert cfg.track.run_name == "${oc.env:DSAFLOW_TEST_SECRET}"
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    back = load_config(tmp_path / "config.yaml")  # what the worker reads: plain values, nothing resolved again
    assert back.track.run_name == "${oc.env:DSAFLOW_TEST_SECRET}" and back.extra == {"k": ["a${b}"]}
    assert "hunter2" not in (tmp_path / "config.yaml").read_text()


def test_an_interpolation_that_cannot_resolve_fails_in_the_parent_naming_the_field(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSAFLOW_TEST_MISSING", raising=False)
    assert main(["train", "data.path=${oc.env:DSAFLOW_TEST_MISSING}"]) == 2
    err = capsys.readouterr().err
    assert "data.path" in err and "DSAFLOW_TEST_MISSING" in err and "Traceback" not in err
    assert files_under(tmp_path) == set()


class Serve:
    def __init__(self, prompts=(), prompts_file=None):
        self.prompts, self.prompts_file, self.max_new_tokens = list(prompts), prompts_file, 4


def test_prompts_split_on_newline_only_and_a_prompt_file_may_be_a_link(tmp_path):
    real = tmp_path / "mine.jsonl"
    real.write_text(json.dumps({"prompt": "a\u2028b\u0085c\x0cd"}, ensure_ascii=False) + "\n" + '{"prompt": "e"}\n')
    link = tmp_path / "link.jsonl"
    os.symlink(real, link)
    got = load_requests(Serve(prompts_file=str(link)))
    assert [p for p, _, _ in got] == ["a\u2028b\u0085c\x0cd", "e"]


@pytest.mark.parametrize(
    "line,match",
    [
        ('{"prompt": "x\\ud800y"}', r"line 1 holds '\\ud800' at character 1"),
        ('{"prompt": "x", "max_new_tokens": ' + "9" * 5000 + "}", r"max_new_tokens='99.*\(5000 characters\)"),
        ('{"prompt": "x", "max_new_tokens": 0}', r"max_new_tokens=0 is not a whole number in \[1, 4194304\]"),
        ('{"prompt": "' + "z" * 100_000, r"not a JSON object .*\(100012 characters\)"),
    ],
)
def test_bad_prompt_lines_are_named_and_quoted_short(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ServeError, match=match) as exc:
        load_requests(Serve(prompts_file=str(path)))
    assert len(str(exc.value)) < 600


def test_bad_text_and_huge_numbers_on_the_command_line_exit_2_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args in (['serve.prompts=["a\udcff"]'], ['serve.prompts=["hi"]', "serve.max_new_tokens=" + "9" * 5000]):
        assert main(["generate", *args, "track=none"]) == 2
        err = capsys.readouterr().err
        assert "Fix:" in err and "Traceback" not in err and len(err) < 800, err
    assert files_under(tmp_path) == set()


def test_fix_hints_stay_within_the_schema(tmp_path):
    huge = fit_problem(0, [1] * (5 << 20), 4, 512, "prompt 0")
    assert "serve.max_context=" not in huge.split("Fix:")[1]  # 5 Mi tokens: beyond serve.max_context's maximum
    assert "serve.max_context=516 or more" in fit_problem(0, [1] * 512, 4, 512, "prompt 0")
