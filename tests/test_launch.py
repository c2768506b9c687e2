"""`dsaflow train`: bad launch configs stop with exit 2 before any process starts and leave nothing on disk; a good
one writes the run dir and trains through torchrun (2 gloo ranks), with the offline tracker writing its run."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from dsaflow import cli
from dsaflow.launch.launch import GPU_ENV_DEFAULTS, launch_env, torchrun_command

TINY = [
    "model.num_layers=4",
    "model.dim=32",
    "model.inter_dim=64",
    "model.index_topk=8",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.progress=lines",
]

BAD = [
    (["train.seq_len=4096"], "train.seq_len=4096"),
    (["train.seq_len=16", "data.num_pairs=4", "data.num_queries=4"], "train.seq_len=16"),  # too short
    (["data.kind=text"], "data.kind=text needs data.path"),
    (["data.kind=bin", "data.path=/nonexistent/tokens.bin"], "data.path=/nonexistent/tokens.bin"),
    (["train.resume=true"], "train.resume=true needs run_dir"),
    (["train.dsa_stage=warmup"], "train.dsa_stage='warmup'"),
    (["track.mode=sometimes"], "track.mode='sometimes'"),
    (["train.stop_at_step=500"], "train.stop_at_step=500"),
    (["pipeline=pp2", "pipeline.schedule=Interleaved1F1B"], "pipeline.schedule=Interleaved1F1B"),
    (["pipeline=pp2", "nproc=3"], "--nproc 3 but the plan has 2"),
    (["pipeline=pp2", "--nproc", "3"], "--nproc 3 but the plan has 2"),
    (["train.batch_size=6", "pipeline.microbatches=4"], "train.batch_size=6"),
]


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """cwd = an empty folder; any attempt to start a process fails the test."""
    monkeypatch.chdir(tmp_path)

    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a}")

    monkeypatch.setattr(subprocess, "call", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return tmp_path


@pytest.mark.parametrize("overrides,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_launch_config_stops_before_any_process(no_launch, capsys, overrides, needle):
    code = cli.main(["train", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "Fix:" in err, err
    assert "Traceback" not in err
    assert list(no_launch.iterdir()) == [], "a failed launch must leave nothing on disk"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_stops(no_launch, capsys):
    assert cli.main(["train", "train.device=cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_resume_without_checkpoint_stops(no_launch, capsys):
    (no_launch / "old").mkdir()
    assert cli.main(["train", "run_dir=old", "train.resume=true"]) == 2
    assert "is not a dsaflow run dir" in capsys.readouterr().err


def test_torchrun_command_and_env():
    cmd = torchrun_command("runs/x", 4, "generate")
    assert cmd[1:] == [
        "-m",
        "dsaflow.launch.agent",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "dsaflow.worker",
        "runs/x",
        "--job",
        "generate",
    ]
    env = launch_env({"NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "1", "a user's own value wins"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == GPU_ENV_DEFAULTS["TORCH_SYMM_MEM_DISABLE_MULTICAST"]
    assert env["OMP_NUM_THREADS"] == "1"  # set, so torchrun prints no OMP banner on multi-rank runs
    assert launch_env({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"


def test_launch_line_and_end_of_run_summary(tmp_path):
    import shlex

    from dsaflow.config.schema import DSAFlowConfig
    from dsaflow.launch.run_summary import plural, shell_command, train_summary

    cmd = torchrun_command(tmp_path / "my run", 2)
    assert shlex.split(shell_command(cmd)) == [str(c) for c in cmd]  # a shell reads back exactly the command
    assert plural(1, "stage") == "1 stage" and plural(2, "rank") == "2 ranks"
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 10.0})
        + "\n"
        + json.dumps({"step": 2, "loss": 1.5, "indexer_loss": 0.1, "eval_acc": 0.75, "tokens_per_s": 12.0})
        + "\n"
    )
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.pipeline.stages import build_stages
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import checkpoint_dir

    small = DSAFlowConfig()
    save_checkpoint(checkpoint_dir(tmp_path, 2), build_stages(small.model, build_plan(small)), None, 0, 2)
    (tmp_path / "wandb" / "offline-run-x").mkdir(parents=True)
    text = train_summary(DSAFlowConfig(), tmp_path, 0)
    assert f"training finished: {tmp_path}" in text
    assert "step 2, loss 1.5000, indexer_loss 0.1, eval_acc 0.750" in text
    assert "step-000002" in text and f"wandb sync {tmp_path / 'wandb' / 'offline-run-x'}" in text
    assert "exit status 3" in train_summary(DSAFlowConfig(), tmp_path, 3)


def test_end_of_run_summary_names_the_checkpoint_without_hashing_it(tmp_path, monkeypatch):
    """The summary checks that the newest checkpoint is complete (sizes), not its sha256 or metadata: hashing a
    large model's checkpoint again at the end of every run would take minutes. A truncated file still fails it."""
    from dsaflow.checkpoint import store
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.config.schema import DSAFlowConfig
    from dsaflow.launch.run_summary import train_summary
    from dsaflow.pipeline.stages import build_stages
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import MANIFEST, checkpoint_dir

    cfg = DSAFlowConfig()
    save_checkpoint(checkpoint_dir(tmp_path, 3), build_stages(cfg.model, build_plan(cfg)), None, 0, 3)

    def refuse(*args):
        raise AssertionError("the summary must not hash or unpickle")

    monkeypatch.setattr(store, "_sha256", refuse)
    monkeypatch.setattr(store, "safe_load_metadata", refuse)
    assert "checkpoint: " + str(checkpoint_dir(tmp_path, 3)) in train_summary(cfg, tmp_path, 0)
    shards = [p for p in checkpoint_dir(tmp_path, 3).iterdir() if p.name != MANIFEST]
    biggest = max(shards, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size - 1)
    assert "checkpoint: (none saved)" in train_summary(cfg, tmp_path, 0)


@pytest.mark.slow
def test_dsaflow_train_end_to_end(tmp_path, monkeypatch, capfd):
    """Two gloo ranks through torchrun, wandb offline, final checkpoint; then the worker entry on the same run dir
    with train.resume picks up nothing left to do is not needed: checked by test_resume."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code = cli.main(
        ["train", *TINY, "pipeline=pp2", "train.steps=3", "train.eval_every=2", "train.log_every=1", f"run_dir={run}"]
    )
    out = capfd.readouterr()
    assert code == 0, out.err[-3000:]
    for name in ("config.yaml", "plan.json", "plan.txt", "metrics.jsonl", "train.log"):
        assert (run / name).is_file(), name
    plan = json.loads((run / "plan.json").read_text())
    assert plan["pipeline"]["ranks"] == 2
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in (
        "loss",
        "lr",
        "tokens_per_s",
        "mfu",
        "indexer_loss",
        "stage0_time_s",
        "stage1_time_s",
        "stage0_indexer_loss",
        "stage1_indexer_loss",
        "pipeline_efficiency",
        "acc",
    ):
        assert key in records[0], key
    assert "eval_acc" in records[1] and "eval_acc" in records[2] and "eval_acc" not in records[0]
    assert (run / "checkpoints" / "step-000003" / ".metadata").is_file()
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1, list((run / "wandb").rglob("*"))
    assert "step 3/3" in out.out


def test_prepare_writes_the_run_dir_and_starts_nothing(no_launch, capsys):
    from dsaflow.launch.launch import main as launch_main

    assert launch_main(["prepare", "run_dir=shared/exp1", "pipeline=pp2"]) == 0
    assert capsys.readouterr().out.strip() == "shared/exp1"
    assert sorted(p.name for p in (no_launch / "shared" / "exp1").iterdir()) == ["config.yaml", "plan.json", "plan.txt"]
    assert launch_main(["prepare", "run_dir=shared/bad", "train.seq_len=99999"]) == 2
    assert not (no_launch / "shared" / "bad").exists()


def test_resume_refuses_a_different_stage_layout(no_launch, capsys):
    from dsaflow.launch.launch import main as launch_main

    assert launch_main(["prepare", "run_dir=r", "pipeline=pp2"]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in (no_launch / "r").iterdir()}
    assert cli.main(["train", "run_dir=r", "pipeline=pp4", "train.resume=true"]) == 2
    assert "cannot be loaded" in capsys.readouterr().err
    assert cli.main(["train", "run_dir=r", "pipeline=pp2"]) == 2  # a run is there, resume not asked
    assert "holds another run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (no_launch / "r").iterdir()} == before, "a refused resume writes nothing"
