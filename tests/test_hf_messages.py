"""Messages that point the right way (issue class "messages that point the wrong way"): each case exits 2 with one
paragraph naming the file or field and the fix, no traceback, and nothing written on disk."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from bad_input_helpers import snapshot

from dsaflow.cli import main
from tests.script_helpers import load_script

HF = load_script("hf_tiny_checkpoint")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    folder = HF.save_checkpoint("deepseek_v32", tmp_path_factory.mktemp("bf16") / "ckpt")
    HF.save_tokenizer(folder)
    return folder


def exits_2(argv, capsys, root: Path, *needles: str) -> str:
    """`dsaflow ARGV` exits 2 with every needle and a Fix in one paragraph on stderr, no traceback, and leaves the
    files under root as they were."""
    before = snapshot(root)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles) and "Fix:" in err and "Traceback" not in err, err
    assert snapshot(root) == before
    return err


def without_tokenizer(bf16: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(bf16, folder)
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize("job", ["generate", "train"])
def test_a_folder_without_tokenizer_json_says_so(bf16, tmp_path, capsys, job):
    folder = without_tokenizer(bf16, tmp_path)
    argv = [job, "model=hf", f"model.hf_path={folder}", "track=none", f"run_dir={tmp_path / 'run'}"]
    argv += ['serve.prompts=["hello"]'] if job == "generate" else ["train.steps=1"]
    err = exits_2(argv, capsys, tmp_path, f"model.hf_path={folder} has no tokenizer.json", "huggingface-cli")
    assert "outside vocab" not in err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_json_that_leads_outside_the_folder_is_refused(bf16, tmp_path, capsys):
    folder = without_tokenizer(bf16, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(bf16 / "tokenizer.json", outside)
    os.symlink(outside, folder / "tokenizer.json")
    argv = ["generate", "model=hf", f"model.hf_path={folder}", 'serve.prompts=["hello"]', "track=none"]
    exits_2(argv + [f"run_dir={tmp_path / 'run'}"], capsys, tmp_path, "tokenizer.json", "outside")


# --- serve.prompts: token ids inline, as in a prompts file -----------------------------------------------------------


def generated(tmp_path: Path, name: str, prompt_args: list) -> list:
    out = tmp_path / f"{name}.jsonl"
    argv = ["generate", *prompt_args, "serve.max_new_tokens=3", f"serve.output_file={out}", "track=none"]
    assert main(argv + [f"run_dir={tmp_path / name}"]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_inline_token_ids_serve_as_the_same_ids_from_a_prompts_file(tmp_path, capfd):
    """Both runs serve the seeded random init, and say so (no checkpoint, no model.hf_path: the warning's only
    check, paid for by these launches)."""
    rows = [{"prompt": [1, 2, 3]}, {"prompt": "hi"}, {"prompt": [7]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = generated(tmp_path, "file", [f"serve.prompts_file={path}"])
    assert "weights are RANDOM" in capfd.readouterr().err
    inline = generated(tmp_path, "inline", ['serve.prompts=[[1,2,3],"hi",[7]]'])
    assert [r["prompt"] for r in inline] == [r["prompt"] for r in rows]
    assert [r["tokens"] for r in inline] == [r["tokens"] for r in from_file]
    assert all(r["num_tokens"] == 3 for r in inline)


@pytest.mark.parametrize("value", ["[[1,-2]]", "[[]]", "[[1,[2]]]", "[[1.5]]", "[{a: 1}]", "[[true]]"])
def test_inline_prompts_that_are_not_token_ids_exit_2(tmp_path, capsys, value, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["generate", f"serve.prompts={value}", "track=none", f"run_dir={tmp_path / 'run'}"]
    exits_2(argv, capsys, tmp_path, "serve.prompts[0]=", "token ids")
    assert not (tmp_path / "run").exists()


def test_inline_token_ids_outside_the_vocabulary_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["generate", "serve.prompts=[[1,99999999]]", "track=none", f"run_dir={tmp_path / 'run'}"]
    exits_2(argv, capsys, tmp_path, "99999999")
    assert not (tmp_path / "run").exists()


# --- generate: the weights it says it serves are the weights it serves --------------------------------------------


def test_generate_from_an_hf_folder_says_where_its_weights_come_from_not_random(bf16, tmp_path, capfd):
    """The worker prints the bytes it read (its own process: capfd)."""
    out = tmp_path / "out.jsonl"
    argv = ["generate", "model=hf", f"model.hf_path={bf16}", 'serve.prompts=["the lazy dog"]']
    argv += ["serve.max_new_tokens=2", f"serve.output_file={out}", "track=none", f"run_dir={tmp_path / 'run'}"]
    assert main(argv) == 0
    got = capfd.readouterr()
    assert "RANDOM" not in got.err and f"MiB of weights from {bf16}" in got.out, got.err[-2000:]
    # a run without weights says RANDOM: test_inline_token_ids_serve_as_the_same_ids_from_a_prompts_file


def test_generate_from_an_hf_folder_without_weights_exits_2(bf16, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(bf16 / name, folder / name)
    argv = ["generate", "model=hf", f"model.hf_path={folder}", 'serve.prompts=["the"]', "track=none"]
    err = exits_2(argv + [f"run_dir={tmp_path / 'run'}"], capsys, tmp_path, str(folder))
    assert "RANDOM" not in err and "MiB of weights" not in err


# --- a failed generate names the logs it wrote ----------------------------------------------------------------------


def test_a_failed_generate_names_its_serve_logs_not_train_log(tmp_path, capsys, monkeypatch):
    """Workers that die (here: a stand-in that writes both ranks' serve logs and exits 1, as a replica killed under
    parallel.dp=2 leaves them) -> the message names serve_rank<r>.log, which exist, and no train.log."""
    import sys

    from dsaflow.launch import launch as launch_module

    def dying_workers(run_dir, nproc, job="train"):
        code = f"import pathlib,sys\nfor r in range({nproc}): (pathlib.Path({str(run_dir)!r}) / f'serve_rank{{r}}.log')"
        return [sys.executable, "-c", code + ".write_text('x')\nsys.exit(1)"]

    monkeypatch.setattr(launch_module, "torchrun_command", dying_workers)
    run = tmp_path / "run"
    argv = ["generate", "parallel.dp=2", "serve.prompts=[hi,there]", "track=none", f"run_dir={run}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{run}/serve_rank0.log, {run}/serve_rank1.log" in err and "train.log" not in err, err
    assert (run / "serve_rank1.log").is_file() and not (run / "train.log").exists()


def test_the_train_log_is_named_for_training_and_a_missing_serve_log_is_said_to_be_missing(tmp_path):
    from dsaflow.launch.launch import worker_logs

    assert worker_logs(tmp_path, "train") == str(tmp_path / "train.log")
    assert "none was written" in worker_logs(tmp_path, "generate")
    for r in range(12):
        (tmp_path / f"serve_rank{r}.log").write_text("x")
    named = worker_logs(tmp_path, "generate")
    assert named.startswith(f"{tmp_path}/serve_rank0.log, {tmp_path}/serve_rank1.log,") and "and 8 more" in named


# --- a run outlives the Hugging Face folder it was trained from ---------------------------------------------------


@pytest.fixture(scope="module")
def run_of_a_deleted_folder(bf16, tmp_path_factory):
    """A 2-step run trained from a copy of the tiny checkpoint, whose folder is then deleted -> (run, the files)."""
    root = tmp_path_factory.mktemp("gone")
    folder = root / "ckpt"
    shutil.copytree(bf16, folder)
    corpus = root / "corpus.txt"
    corpus.write_text((HF.TEXT + "\n") * 40)  # bytes such as 'q' (113) lie outside the model's 96 ids
    run = root / "run"
    argv = ["train", "model=hf", f"model.hf_path={folder}", "data=text", f"data.path={corpus}", "train.steps=2"]
    argv += ["train.seq_len=32", "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "track=none"]
    assert main(argv + [f"run_dir={run}"]) == 0
    kept = {p.name: p.read_bytes() for p in (folder).iterdir() if not p.name.endswith("safetensors")}
    shutil.rmtree(folder)
    return run, kept


@pytest.mark.slow
def test_a_run_keeps_its_tokenizer_and_resumes_serves_and_exports_without_the_folder(run_of_a_deleted_folder, capfd):
    run, kept = run_of_a_deleted_folder
    copy = {p.name: p.read_bytes() for p in (run / "hf_files").iterdir()}
    from dsaflow.checkpoint.hf_run_copy import COPIED

    assert {"config.json", "tokenizer.json"} <= set(copy) == {n for n in kept if n in COPIED}
    assert all(copy[n] == kept[n] for n in copy)
    assert main(["train", "train.resume=true", "train.steps=3", f"run_dir={run}"]) == 0
    out = run.parent / "out.jsonl"
    argv = ["generate", f"serve.checkpoint={run}", 'serve.prompts=["the lazy dog"]', "serve.max_new_tokens=2"]
    assert main(argv + [f"serve.output_file={out}", "track=none", f"run_dir={run.parent / 'gen'}"]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    from dsaflow.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(run / "hf_files" / "tokenizer.json")  # the completion is decoded by the run's tokenizer
    assert row["completion"] == tok.decode(row["tokens"]) and max(row["tokens"]) < 96
    assert main(["export", f"export.checkpoint={run}", f"export.out_dir={run.parent / 'exp'}"]) == 0
    assert (run.parent / "exp" / "tokenizer.json").read_bytes() == kept["tokenizer.json"]
    assert json.loads((run.parent / "exp" / "config.json").read_text())["model_type"] == "deepseek_v32"
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_run_without_a_copy_whose_folder_is_gone_exits_2_naming_both(run_of_a_deleted_folder, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_of_a_deleted_folder[0], run)
    shutil.rmtree(run / "hf_files")
    needles = ("does not exist, and the run", str(run / "hf_files"))
    exits_2(["train", "train.resume=true", "train.steps=3", f"run_dir={run}"], capsys, tmp_path, *needles)
    argv = ["generate", f"serve.checkpoint={run}", 'serve.prompts=["the"]', "track=none", f"run_dir={tmp_path / 'g'}"]
    exits_2(argv, capsys, tmp_path, *needles)
    exits_2(["export", f"export.checkpoint={run}", f"export.out_dir={tmp_path / 'exp'}"], capsys, tmp_path, *needles)
    assert not (tmp_path / "g").exists() and not (tmp_path / "exp").exists()
