"""What a newcomer types at the front door: help examples that bash accepts, completion that completes, the
sweeper plugin named when missing, a quiet `| head`, WANDB_MODE=disabled, an interrupt hint that works, and a
hand-run torchrun with the wrong process count. The CLI runs as `python -m dsaflow.cli` in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsaflow.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
DSAFLOW = [sys.executable, "-m", "dsaflow.cli"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def dsaflow(*args, env=None, timeout=120, **kw):
    return subprocess.run(
        [*DSAFLOW, *args], capture_output=True, text=True, cwd=REPO, env={**ENV, **(env or {})}, timeout=timeout, **kw
    )


def _command_lines(text: str):
    """Lines that are commands: `dsaflow ...` / `python -m dsaflow...` (comments cut), continuation lines joined."""
    text = text.replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("dsaflow ", "python -m dsaflow")):
            yield re.sub(r"\s+#.*$", "", line)


def _bash_syntax_errors(lines):
    bad = []
    for line in lines:
        check = subprocess.run(
            ["bash", "-n", "-c", line.replace("<", "_").replace(">", "_")], capture_output=True, text=True
        )
        if check.returncode:
            bad.append(f"{line}\n  {check.stderr.strip()}")
    return bad


def test_every_help_example_is_valid_bash():
    lines = [ln for cmd in COMMANDS for ln in _command_lines(dsaflow(cmd, "--help").stdout)]
    lines += list(_command_lines(dsaflow("--help").stdout))
    assert len(lines) > 10
    assert not _bash_syntax_errors(lines)


def test_every_documented_command_is_valid_bash():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [b for p in docs for b in re.findall(r"```(?:bash|sh)?\n(.*?)```", p.read_text(), re.S)]
    lines = [ln for block in blocks if " -> " not in block for ln in _command_lines(block)]  # not the flow diagrams
    assert any("range(" in ln for ln in lines)
    assert not _bash_syntax_errors(lines)


def test_generate_help_lists_every_serve_field_and_a_prompts_file_the_command_accepts():
    from dataclasses import fields

    from dsaflow.config.schema import ServeConfig

    out = dsaflow("generate", "--help").stdout
    for f in fields(ServeConfig):
        assert f"serve.{f.name}=" in out, f.name
    assert "prompts.txt" not in out and 'prompts.jsonl: one JSON object per line, {"prompt":' in out
    search = dsaflow("search", "--help").stdout
    assert "search.calib_batches=8" in search and "serve." not in search


def test_missing_sweeper_plugin_names_the_package_to_install(monkeypatch):
    import importlib.util

    from dsaflow.app import check_sweeper_plugin
    from dsaflow.errors import ConfigError

    real_find_spec = importlib.util.find_spec
    optuna = "hydra_plugins.hydra_optuna_sweeper"  # hidden, as on a machine without the Optuna plugin
    hide = lambda name, *a: None if name == optuna else real_find_spec(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    with pytest.raises(ConfigError, match=r"pip install hydra-optuna-sweeper"):
        check_sweeper_plugin(["hydra/sweeper=optuna"])
    check_sweeper_plugin(["hydra/sweeper=basic", "a=1,2"])
    res = dsaflow("train", "-m", "hydra/sweeper=nosuch", "train.steps=1", "track=none")
    assert res.returncode == 2
    assert "pip install hydra-nosuch-sweeper" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.startswith("dsaflow: error: ") and len(res.stderr.strip().splitlines()) == 1


def test_shell_completion_installs_for_dsaflow_and_completes_commands_and_options(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    entry = bindir / "dsaflow"  # what pip's console script does: argv[0] is .../dsaflow
    entry.write_text(f"#!{sys.executable}\nimport sys\nfrom dsaflow.cli import main\nsys.exit(main())\n")
    entry.chmod(0o755)
    env = {**ENV, "PATH": f"{bindir}:{os.environ['PATH']}"}
    script = subprocess.run([str(entry), "-sc", "install=bash"], capture_output=True, text=True, env=env, cwd=REPO)
    assert script.returncode == 0 and "complete" in script.stdout and "dsaflow" in script.stdout
    (tmp_path / "completion.sh").write_text(script.stdout)

    def complete(line: str) -> list:
        words = line.split() + ([""] if line.endswith(" ") else [])
        probe = (
            f'source {tmp_path / "completion.sh"}; COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; '
            f'COMP_CWORD={len(words) - 1}; hydra_bash_completion; echo "${{COMPREPLY[@]}}"'
        )
        res = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert complete("dsaflow tr") == ["train"]
    assert complete("dsaflow train model=ds") == ["model=dsv32"]  # one option starts with ds
    assert "serve.max_new_tokens=" in complete("dsaflow generate serve.max_n")
    refused = dsaflow("-sc", "install=bash")  # python -m dsaflow.cli: no command name a shell could complete
    assert refused.returncode == 2 and "Fix:" in refused.stderr and "Traceback" not in refused.stderr


def test_info_into_a_closed_pipe_exits_quietly():
    res = subprocess.run(
        f"{sys.executable} -m dsaflow.cli train --info | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert res.stdout.startswith("Hydra")
    assert res.stderr == ""


def test_wandb_mode_disabled_turns_the_tracker_off(monkeypatch, tmp_path):
    from dsaflow.config.compose import compose
    from dsaflow.track import NullTracker, make_tracker

    assert str(compose([]).track.mode) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = compose([])
    assert str(cfg.track.mode) == "disabled"
    cfg.track.mode = "offline"  # a run dir written without the variable, run by a worker that has it
    assert isinstance(make_tracker(cfg, str(tmp_path), is_logging_rank=True), NullTracker)


def test_interrupt_hint_offers_resume_only_when_a_checkpoint_exists(tmp_path):
    from dsaflow.launch.launch import interrupt_hint

    assert "train.resume=true" not in interrupt_hint(tmp_path, "train")
    assert "train.ckpt_every=N" in interrupt_hint(tmp_path, "train")
    (tmp_path / "checkpoints" / "step-000020").mkdir(parents=True)
    assert f"step 20 was saved; continue with train.resume=true run_dir={tmp_path}" in interrupt_hint(tmp_path, "train")
    assert interrupt_hint(tmp_path, "generate") == ""


def test_the_interrupt_message_starts_on_its_own_line_on_a_terminal(tmp_path):
    from dsaflow.launch.launch import interrupted_message

    on_tty = interrupted_message("train", signal.SIGINT, 3, tmp_path, tty=True)
    assert on_tty.startswith("\ndsaflow train: interrupted (SIGINT)") and on_tty.count("\n") == 1
    assert interrupted_message("train", signal.SIGINT, 3, tmp_path, tty=False).startswith("dsaflow train:")


@pytest.mark.slow
def test_ctrl_c_on_a_run_without_checkpoints_does_not_suggest_a_resume_that_would_be_refused(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*DSAFLOW, "train", "train.steps=100000", "track=none", f"run_dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=ENV,
    )
    try:
        for line in proc.stdout:  # interrupt once training runs
            if line.startswith("training "):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted (SIGINT)" in err and "train.resume=true" not in err and "train.ckpt_every=N" in err


@pytest.mark.slow
def test_hand_run_launch_with_the_wrong_process_count_is_one_paragraph_and_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    prep = subprocess.run(
        [sys.executable, "-m", "dsaflow.launch.launch", "prepare", f"run_dir={run_dir}", "track=none"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert prep.returncode == 0, prep.stderr
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsaflow.launch.agent",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dsaflow.worker",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=300,
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # one paragraph: no banner, no per-rank copies
    assert "WORLD_SIZE=2" in res.stderr and "Fix: launch exactly 1 process" in res.stderr


def test_readme_generate_prompts_are_the_held_out_task_and_the_readme_lists_their_answers():
    import json

    from dsaflow.config.compose import compose

    path = REPO / "docs" / "retrieval_prompts.jsonl"
    made = subprocess.run(
        [sys.executable, "scripts/retrieval_prompts.py", "--count", "8"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )
    assert made.returncode == 0 and made.stdout == path.read_text()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    seq_len = compose([]).train.seq_len
    for r in rows:  # input of the training length, the query's key holding the answer earlier in the filler
        prompt, key, answer = r["prompt"], r["prompt"][-1], r["answer"]
        assert len(prompt) == seq_len and prompt[-2] == "?" and f" {key}{answer};" in prompt
    assert "serve.prompts_file=docs/retrieval_prompts.jsonl" in (REPO / "README.md").read_text()
    assert f"in order `{' '.join(r['answer'] for r in rows)}`" in (REPO / "README.md").read_text()


def readme_examples() -> list:
    """The command lines of README.md's "Examples that run as written" block (continuation lines joined)."""
    text = (REPO / "README.md").read_text()
    block = text.split("Examples that run as written", 1)[1].split("```", 2)[1]
    lines = list(_command_lines(block))
    assert len(lines) >= 8 and any(line.startswith("dsaflow generate") for line in lines)
    return lines


# What the tests add to the README's examples that leave them out (the README shows runs long enough to learn): a
# few steps keep each example's command path whole at a fraction of its time.
TEST_TRAIN_STEPS = "train.steps=4"
TEST_SEARCH_BATCHES = ("search.calib_batches=2", "search.eval_batches=4")


def shortened(line: str) -> str:
    """`line` with the test's step and batch counts appended where it sets none of its own: `train.steps=4` on a
    `dsaflow train` line, the search's calibration and evaluation batch counts on a `dsaflow search` line (a later
    override of a key wins in Hydra, so only a missing key is added)."""
    if line.startswith("dsaflow train ") and "train.steps=" not in line:
        return f"{line} {TEST_TRAIN_STEPS}"
    if line.startswith("dsaflow search "):
        missing = [o for o in TEST_SEARCH_BATCHES if o.split("=")[0] + "=" not in line]
        return " ".join([line, *missing])
    return line


def standalone_training(line: str) -> bool:
    """A README example that trains on its own (not on the main job's run dir): tests/test_readme_training.py runs
    these, test_the_readme_examples_on_the_main_jobs_run_dir_run_verbatim every other one."""
    return line.startswith("dsaflow train ") and "runs/" not in line


def run_verbatim(lines, tmp_path: Path) -> None:
    """Each line pasted into bash as given, one after the other, in a fresh folder holding only the repository's
    docs/: each exits 0."""
    shim = tmp_path / "bin" / "dsaflow"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m dsaflow.cli "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "docs").symlink_to(REPO / "docs")
    env = {**ENV, "PATH": f"{shim.parent}:{os.environ['PATH']}", "WANDB_MODE": "offline"}
    for line in lines:
        res = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"{line}\n{res.stdout[-1500:]}\n{res.stderr[-1500:]}"


@pytest.mark.slow
def test_the_readme_examples_on_the_main_jobs_run_dir_run_verbatim(tmp_path):
    """The README's examples other than the standalone trainings (the plans, generate and search on the main job's
    run dir), pasted into bash as written in a fresh folder: each exits 0. A 2-step `dsaflow train` stands in for
    the main job whose run dir the last ones use; the standalone trainings run in tests/test_readme_training.py
    (another file, so that pytest-xdist can run the two halves at once)."""
    lines = [line for line in readme_examples() if not standalone_training(line)]
    assert any("runs/*-tiny-retrieval" in line for line in lines) and any(
        line.startswith("dsaflow plan") for line in lines
    )
    run_verbatim(["dsaflow train train.steps=2 track=none", *map(shortened, lines)], tmp_path)
