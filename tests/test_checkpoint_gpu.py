"""Checkpoints on GPUs through the real launch path (NCCL with launch.timeout_s, CUDA tensors saved through the
safetensors package): train, resume under the run dir's lock, prune to this run's newest good checkpoint, then
serve the weights the manifest lists. Skipped without CUDA devices."""

from __future__ import annotations

import json

import pytest

from dsaflow import cli
from dsaflow.checkpoint.store import read_run_id, verify_checkpoint
from dsaflow.rundir.folder import MANIFEST, list_checkpoints, read_metrics

SMALL = [
    "model.num_layers=4",
    "model.dim=64",
    "train.seq_len=128",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=lines",
    "track=none",
    "train.device=cuda",
    "train.ckpt_every=1",
    "train.keep_checkpoints=1",
    "launch.timeout_s=120",
]


def _train_resume_serve(tmp_path, monkeypatch, *extra):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert cli.main(["train", *SMALL, *extra, "train.steps=2", f"run_dir={run}"]) == 0
    assert [s for s, _ in list_checkpoints(run)] == [2]
    assert cli.main(["train", *SMALL, *extra, "train.steps=3", "train.resume=true", f"run_dir={run}"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    [(step, folder)] = list_checkpoints(run)
    manifest = verify_checkpoint(folder)
    assert step == 3 and manifest["run_id"] == read_run_id(run)
    assert json.loads((folder / MANIFEST).read_text())["files"].keys() >= {"model-rank0.safetensors", ".metadata"}
    out = tmp_path / "out.jsonl"
    assert (
        cli.main(
            [
                "generate",
                *[a for a in SMALL if a.startswith(("model.", "launch."))],
                *extra,
                f"serve.checkpoint={run}",
                'serve.prompts=["K7; ?K"]',
                "serve.max_new_tokens=4",
                f"serve.output_file={out}",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]["tokens"]) >= 1


@pytest.mark.gpu
def test_one_gpu_saves_resumes_prunes_and_serves(tmp_path, monkeypatch):
    _train_resume_serve(tmp_path, monkeypatch)


@pytest.mark.multigpu
def test_two_gpus_save_resume_prune_and_serve(tmp_path, monkeypatch):
    _train_resume_serve(tmp_path, monkeypatch, "pipeline=pp2")
