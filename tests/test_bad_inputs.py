"""Bad inputs a new user types: every one exits with status 2 before any process starts, names the field (or file),
prints no traceback and leaves nothing on disk (cwd stays empty; a run dir that was there is left byte for byte).

Configs, data files, prompts, checkpoints (including one whose metadata is an executing pickle) and run dirs. All but
a few run in-process through `dsaflow.cli.main`; `test_bad_inputs_through_the_real_cli` runs a handful as
subprocesses of the installed entry point."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bad_input_helpers import crafted_checkpoint, crafted_run_dir

from dsaflow import cli

SMALL = ["track=none", "model.num_layers=4", "train.seq_len=32", "train.batch_size=4", "train.steps=2"]
PROMPT = ['serve.prompts=["hello"]']

# (job, overrides, needle): overrides may use {files} (a folder outside cwd holding prepared files) and {cwd}.
CONFIG_CASES = [
    # ranges and choices, declared in dsaflow/config/schema.py and refused at compose
    ("train", ["train.lr=-0.001"], "train.lr=-0.001 is out of range"),
    ("train", ["train.lr=0"], "train.lr=0 is out of range"),
    ("train", ["train.lr=nan"], "train.lr=nan"),
    ("train", ["train.indexer_lr=-1"], "train.indexer_lr=-1"),
    ("train", ["train.betas=[0.9,1.0]"], "train.betas="),
    ("train", ["train.betas=[-0.1,0.9]"], "train.betas="),
    ("train", ["train.betas=[0.9]"], "train.betas="),
    ("train", ["train.min_lr_ratio=-0.1"], "train.min_lr_ratio=-0.1"),
    ("train", ["train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5"),
    ("train", ["train.warmup_steps=-5"], "train.warmup_steps=-5"),
    ("train", ["train.weight_decay=-0.1"], "train.weight_decay=-0.1"),
    ("train", ["train.grad_clip=-1"], "train.grad_clip=-1"),
    ("train", ["train.indexer_loss_weight=-1"], "train.indexer_loss_weight=-1"),
    ("train", ["train.steps=0"], "train.steps=0"),
    ("train", ["train.seq_len=0"], "train.seq_len=0"),
    ("train", ["train.batch_size=0"], "train.batch_size=0"),
    ("train", ["train.batch_size=100000000"], "train.batch_size=100000000"),
    ("train", ["train.log_every=0"], "train.log_every=0"),
    ("train", ["train.eval_every=-1"], "train.eval_every=-1"),
    ("train", ["train.eval_batches=0"], "train.eval_batches=0"),
    ("train", ["train.ckpt_every=-2"], "train.ckpt_every=-2"),
    ("train", ["train.keep_checkpoints=0"], "train.keep_checkpoints=0"),
    ("train", ["train.stop_at_step=0"], "train.stop_at_step=0"),
    ("train", ["train.cpu_threads=0"], "train.cpu_threads=0"),
    ("train", ["train.dense_warmup_steps=-1"], "train.dense_warmup_steps=-1"),
    ("train", ["train.seed=-1"], "train.seed=-1"),
    ("train", ["train.peak_tflops=0"], "train.peak_tflops=0"),
    ("train", ["train.dsa_stage=warmup"], "train.dsa_stage='warmup'"),
    ("train", ["train.dtype=fp16"], "train.dtype='fp16'"),
    ("train", ["train.device=tpu"], "train.device='tpu'"),
    ("train", ["train.progress=bar"], "train.progress='bar'"),
    # a config group given a number, null or no key: the options, not Hydra's traceback
    ("train", ["pipeline=2"], "pipeline=2: pipeline is a config group"),
    ("train", ["model=1.5"], "model=1.5: model is a config group"),
    ("plan", ["index=4"], "Fix: use one of all_full, every2, every4"),
    ("train", ["train=null"], "train=null: train is a config group"),
    ("plan", ["=5"], "=5: the override has no key"),
    ("train", ["model.dim=0"], "model.dim=0"),
    ("train", ["model.num_layers=0"], "model.num_layers=0"),
    ("train", ["model.n_heads=-4"], "model.n_heads=-4"),
    ("train", ["model.index_topk=0"], "model.index_topk=0"),
    ("train", ["model.index_topk=100000000"], "model.index_topk=100000000"),
    ("train", ["model.vocab_size=0"], "model.vocab_size=0"),
    ("train", ["model.vocab_size=100000000"], "model.vocab_size=100000000"),
    ("train", ["model.max_seq_len=0"], "model.max_seq_len=0"),
    ("train", ["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim=7"),
    ("train", ["model.index_rope_head_dim=3"], "model.index_rope_head_dim=3"),
    ("train", ["model.index_rope_head_dim=32"], "model.index_rope_head_dim=32"),
    ("train", ["model.norm_eps=0"], "model.norm_eps=0"),
    ("train", ["model.rope_theta=-1"], "model.rope_theta=-1"),
    ("train", ["model.init_std=0"], "model.init_std=0"),
    ("train", ["model.inter_dim=0"], "model.inter_dim=0"),
    ("train", ["index.freq=0"], "index.freq=0"),
    ("train", ["index.offset=-1"], "index.offset=-1"),
    ("train", ["pipeline.stages=0"], "pipeline.stages=0"),
    ("train", ["pipeline.ranks=0"], "pipeline.ranks=0"),
    ("train", ["pipeline.microbatches=0"], "pipeline.microbatches=0"),
    ("train", ["pipeline.schedule=Zigzag"], "pipeline.schedule='Zigzag'"),
    ("train", ["pipeline.balance=flops"], "pipeline.balance='flops'"),
    ("train", ["index.promote=false", "layout=FS|SF"], "index.promote=false"),
    ("train", ["graphs.on_failure=ignore"], "graphs.on_failure='ignore'"),
    ("train", ["graphs.max_shape=0"], "graphs.max_shape=0"),
    ("train", ["data.kind=csv"], "data.kind='csv'"),
    ("train", ["data.loss_on=some"], "data.loss_on='some'"),
    ("train", ["data.val_fraction=1.0"], "data.val_fraction=1"),
    ("train", ["data.val_fraction=-0.5"], "data.val_fraction=-0.5"),
    ("train", ["data.num_pairs=0"], "data.num_pairs=0"),
    ("train", ["data.key_len=0"], "data.key_len=0"),
    ("train", ["track.mode=sometimes"], "track.mode='sometimes'"),
    ("train", ["track.backend=mlflow"], "track.backend='mlflow'"),
    ("train", ["mode=infer"], "mode='infer'"),
    ("train", ["estimate_context=0"], "estimate_context=0"),
    ("train", ["model.dim=wide"], "model.dim='wide'"),
    ("train", ["+train.learning_rate=0.1"], "train.learning_rate"),
    # cross-field and launch checks (parent)
    ("train", ["train.seq_len=4096"], "train.seq_len=4096"),
    ("train", ["train.stop_at_step=50"], "train.stop_at_step=50"),
    ("train", ["train.seq_len=16", "data.num_pairs=4", "data.num_queries=4"], "train.seq_len=16"),
    ("train", ["data.num_pairs=30", "train.seq_len=256", "model.max_seq_len=1024"], "data.key_len=1"),
    ("train", ["train.batch_size=6", "pipeline.microbatches=4"], "train.batch_size=6"),
    ("train", ["train.resume=true"], "train.resume=true needs run_dir"),
    ("train", ["track=online"], "track=online"),
    # sizes no machine holds: the pre-launch memory check names the largest consumer
    ("train", ["model.index_topk=65536", "train.batch_size=1024"], "largest consumer"),
    ("train", ["model.vocab_size=2000000", "model.dim=65536"], "largest consumer"),
    ("train", ["train.batch_size=1000000", "pipeline.microbatches=1"], "largest consumer"),
    (
        "generate",
        [*PROMPT, "serve.max_batch=4096", "serve.max_context=4000000", "model.max_seq_len=4000000"],
        "largest consumer",
    ),
    # serving fields
    ("generate", ["serve.max_batch=0", *PROMPT], "serve.max_batch=0"),
    ("generate", ["serve.max_batch=100000", *PROMPT], "serve.max_batch=100000"),
    ("generate", ["serve.max_context=0", *PROMPT], "serve.max_context=0"),
    ("generate", ["serve.prefill_chunk=0", *PROMPT], "serve.prefill_chunk=0"),
    ("generate", ["serve.top_p=1.5", *PROMPT], "serve.top_p=1.5"),
    ("generate", ["serve.temperature=-0.5", *PROMPT], "serve.temperature=-0.5"),
    ("generate", ["serve.dtype=int8", *PROMPT], "serve.dtype='int8'"),
    ("generate", ["serve.eos_id=256", *PROMPT], "serve.eos_id=256"),
    # prompts
    ("generate", [], "no prompts"),
    ("generate", ['serve.prompts=[""]'], "prompt 0 is empty"),
    ("generate", ["serve.prompts_file={files}/missing.jsonl"], "serve.prompts_file="),
    ("generate", ["serve.prompts_file={files}/bad.jsonl"], "line 2"),
    ("generate", ["serve.prompts_file={files}/empty.jsonl"], "holds no prompts"),
    ("generate", [*PROMPT, "serve.prompts_file={files}/good.jsonl"], "both serve.prompts"),
    ("generate", ['serve.prompts=["' + "x" * 600 + '"]'], "serve.max_context=512"),
    # data files
    ("train", ["data=text"], "data.kind=text needs data.path"),
    ("train", ["data=text", "data.path={files}/nope.txt"], "data.path="),
    ("train", ["data=text", "data.path={files}/emptydir"], "holds no"),
    ("train", ["data=text", "data.path={files}/short.txt"], "fewer than train.seq_len + 1"),
    ("train", ["data=bin", "data.path={files}/odd.bin"], "odd size"),
    ("train", ["data=bin", "data.path={files}/oov.bin"], "model.vocab_size=256"),
    ("train", ["data=bin", "data.path={files}/emptydir"], "is a folder"),
    # checkpoints
    ("generate", [*PROMPT, "serve.checkpoint={files}/nothing"], "serve.checkpoint="),
    ("generate", [*PROMPT, "serve.checkpoint={files}/emptydir"], "serve.checkpoint="),
    ("generate", [*PROMPT, "serve.checkpoint={files}/crafted/checkpoints/step-000001"], "refus"),
    ("generate", [*PROMPT, "serve.checkpoint={files}/crafted"], "serve.checkpoint="),
    ("generate", [*PROMPT, "serve.checkpoint={files}/truncated"], "truncated"),
    ("train", ["train.resume=true", "run_dir={files}/crafted"], "no complete checkpoint"),
    # run dirs
    ("train", ["run_dir={files}/afile"], "is not a folder"),
    ("train", ["run_dir={files}/afile/sub"], "is a file"),
    ("train", ["run_dir={files}/notempty"], "is not empty"),
    ("train", ["run_dir={files}/crafted"], "holds another run"),
    (
        "train",
        ["run_dir={files}/crafted", "train.resume=true", "model.dim=32"],
        "model.dim is 64 in the run, 32 as given",
    ),
    ("train", ["run_dir={files}/crafted", "train.resume=true", "index=every4"], "layer roles"),
    ("train", ["run_dir={files}/crafted", "train.resume=true", "pipeline=pp2"], "stages"),
    ("train", ["run_dir={files}/crafted", "train.resume=true", "train.seed=3"], "train.seed"),
    ("train", ["run_dir={files}/crafted/checkpoints/step-000001"], "lies inside"),
    ("train", ["run_dir={files}/crafted/checkpoints/step-000001/again"], "lies inside"),
    ("train", ["run_dir={files}/" + "x" * 300], "too long"),
    # corrupted or planted run-dir files on resume, and in a served run dir
    ("train", ["run_dir={files}/emptycfg", "train.resume=true"], "is empty"),
    ("train", ["run_dir={files}/badplan", "train.resume=true"], "plan.json"),
    ("train", ["run_dir={files}/badmetrics", "train.resume=true"], "line 2"),
    ("train", ["run_dir={files}/linkedmetrics", "train.resume=true"], "symbolic link"),
    ("generate", [*PROMPT, "serve.checkpoint={files}/servedemptycfg"], "is empty"),
    # layouts a parser must survive
    ("train", ["layout=((F)*1000)*1000"], "expands to"),
    ("train", ["layout=" + "(" * 40 + "F" + ")" * 40], "nest deeper"),
    ("train", ["layout=F*99999999999999999999999"], "too large"),
    ("train", ["layout=" + "F" * 20000], "characters long"),
    # every search.* and launch.* field has a range
    ("train", ["search.eval_ratios=[0]"], "search.eval_ratios="),
    ("train", ["search.eval_ratios=[0.5,2]"], "search.eval_ratios="),
    ("train", ["search.ratio=0"], "search.ratio=0"),
    ("train", ["search.ratio=1.5"], "search.ratio=1.5"),
    ("train", ["search.target_f=0"], "search.target_f=0"),
    ("train", ["search.calib_batches=0"], "search.calib_batches=0"),
    ("train", ["search.eval_batches=-1"], "search.eval_batches=-1"),
    ("train", ["search.device=tpu"], "search.device='tpu'"),
    ("train", ["launch.timeout_s=0"], "launch.timeout_s=0"),
    # data and prompt files that are not what they claim
    ("train", ["data=bin", "data.path={files}/zero.bin"], "is empty"),
    ("train", ["data=text", "data.path={files}/zero.txt"], "is empty"),
    ("train", ["data=bin", "data.path={files}/fifo"], "FIFO"),
    ("train", ["data=text", "data.path={files}/fifo"], "FIFO"),
    ("train", ["data=text", "data.path={files}/" + "y" * 300], "too long"),
    ("generate", ["serve.prompts_file={files}/numbers.jsonl"], "line 2"),
    ("generate", ["serve.prompts_file={files}/nullprompt.jsonl"], "line 1"),
    ("generate", ["serve.prompts_file={files}/listprompt.jsonl"], "line 1"),
    ("generate", ["serve.prompts_file={files}/fifo"], "FIFO"),
    ("generate", ["serve.prompts_file={files}/emptydir"], "folder"),
    # where the completions go, checked before anything is generated
    ("generate", [*PROMPT, "serve.output_file={files}/emptydir"], "is a folder"),
    ("generate", [*PROMPT, "serve.output_file={files}/nodir/out.jsonl"], "does not exist"),
]


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
        for p in sorted(root.rglob("*"))
    }


def good_run_dir(run_dir: Path, steps=(1,)) -> Path:
    """A run dir of SMALL (train.steps=2) with real checkpoints at `steps`."""
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.config.compose import compose
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan, render_table
    from dsaflow.rundir.folder import checkpoint_dir, write_run_dir

    cfg = compose([*SMALL, f"run_dir={run_dir}"])
    plan = build_plan(cfg)
    write_run_dir(cfg, plan, render_table(plan, cfg))
    for step in steps:
        save_checkpoint(checkpoint_dir(run_dir, step), [stage_module(cfg.model, plan, 0, seed=0)], None, 0, step)
    return run_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    (d / "empty.jsonl").write_text("\n")
    (d / "good.jsonl").write_text('{"prompt": "ok"}\n')
    (d / "emptydir").mkdir()
    (d / "short.txt").write_text("too short")
    (d / "odd.bin").write_bytes(b"\0" * 2001)
    np.arange(4000, dtype=np.uint16).tofile(d / "oov.bin")  # ids up to 3999 >= vocab 256
    (d / "afile").write_text("x")
    (d / "notempty").mkdir()
    (d / "notempty" / "mine.txt").write_text("user data")
    crafted_run_dir(d / "crafted", d / "PWNED", SMALL)
    (d / "zero.bin").write_bytes(b"")
    (d / "zero.txt").write_bytes(b"")
    os.mkfifo(d / "fifo")
    (d / "numbers.jsonl").write_text('{"prompt": "ok"}\n{"prompt": 12345}\n')
    (d / "nullprompt.jsonl").write_text('{"prompt": null}\n')
    (d / "listprompt.jsonl").write_text('{"prompt": ["a"]}\n')
    for name, edit in (
        ("emptycfg", lambda r: (r / "config.yaml").write_text("")),
        ("badplan", lambda r: (r / "plan.json").write_text('{"layers": [')),
        ("badmetrics", lambda r: (r / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 2}\n')),
        ("linkedmetrics", lambda r: (r / "metrics.jsonl").symlink_to(d / "afile")),
    ):
        shutil.copytree(d / "crafted", d / name, symlinks=True)
        edit(d / name)
    served = good_run_dir(d / "servedemptycfg")
    (served / "config.yaml").write_text("")
    # a checkpoint folder whose shard is shorter than its manifest says
    from dsaflow.checkpoint.store import write_manifest

    t = d / "truncated"
    t.mkdir()
    import pickle

    (t / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    (t / "model-rank0.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}" + b"\0" * 100)
    write_manifest(t, 1)
    with open(t / "model-rank0.safetensors", "r+b") as f:
        f.truncate(20)
    return d


@pytest.fixture
def empty_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path.parent / "no-netrc"))

    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a}")

    monkeypatch.setattr(subprocess, "call", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return tmp_path


@pytest.mark.parametrize(
    "job,overrides,needle", CONFIG_CASES, ids=[f"{c[0]}:{' '.join(c[1])[:60]}" for c in CONFIG_CASES]
)
def test_bad_input_exits_2_names_the_field_and_writes_nothing(files, empty_cwd, capsys, job, overrides, needle):
    before = _snapshot(files)
    args = [o.format(files=files, cwd=empty_cwd) for o in overrides]
    code = cli.main([job, *SMALL, *args])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert needle in out.err and "Fix:" in out.err, out.err
    assert "Traceback" not in out.err + out.out
    assert list(empty_cwd.iterdir()) == [], "a refused launch must leave nothing on disk"
    assert _snapshot(files) == before, "prepared files and run dirs must be left untouched"
    assert not (files / "PWNED").exists(), "a crafted pickle was executed"


def test_at_least_80_cases():
    assert len(CONFIG_CASES) >= 80


def test_a_run_dir_in_use_is_refused_naming_its_holder(files, empty_cwd, capsys):
    """A resume of a run dir another launch holds stops before anything starts, naming that launch."""
    from dsaflow.rundir.lock import run_dir_lock

    run = good_run_dir(empty_cwd.parent / "inuse")
    with run_dir_lock(run, "train"):
        before = _snapshot(run)
        code = cli.main(["train", *SMALL, f"run_dir={run}", "train.resume=true"])
        err = capsys.readouterr().err
        assert code == 2 and f"is in use by `dsaflow train` (pid {os.getpid()}" in err and "Fix:" in err, err
        assert _snapshot(run) == before and list(empty_cwd.iterdir()) == []


def test_ctrl_c_during_the_prelaunch_checks_is_one_line(empty_cwd, capsys, monkeypatch):
    from dsaflow.data import BatchSource

    def interrupted(self):
        raise KeyboardInterrupt  # the corpus scan of a large data.path, cut short

    monkeypatch.setattr(BatchSource, "check_vocab", interrupted)
    assert cli.main(["train", *SMALL]) == 130
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "interrupted during the pre-launch checks" in err, err
    assert list(empty_cwd.iterdir()) == []


def as_torchrun_rank(monkeypatch, rank: str) -> None:
    """The environment torchrun gives a worker (no dsaflow parent), so the worker's own checks are reached."""
    for name, value in {"RANK": rank, "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DSAFLOW_PARENT", raising=False)


@pytest.mark.parametrize("job", ["train", "generate"])
def test_a_worker_run_by_hand_outside_torchrun_says_how_to_start_it(tmp_path, capsys, monkeypatch, job):
    from dsaflow import worker

    run = good_run_dir(tmp_path / "run")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DSAFLOW_PARENT"):
        monkeypatch.delenv(name, raising=False)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as e:
        worker.main([str(run), "--job", job])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in err and "torchrun" in err
    assert f"-m dsaflow.worker {run} --job {job}" in err and "dsaflow.launch.agent" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_hand_started_worker_refuses_an_edited_plan(tmp_path, capsys, monkeypatch):
    import json

    from dsaflow import worker

    run = good_run_dir(tmp_path / "run")
    plan = json.loads((run / "plan.json").read_text())
    plan["stages"][0]["layers"] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    (run / "plan.json").write_text(json.dumps(plan))
    as_torchrun_rank(monkeypatch, "0")
    monkeypatch.setattr("dsaflow.launch.lifecycle.die_with_parent", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        worker.main([str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not the plan of" in err and "Traceback" not in err, err


def test_crafted_pickle_is_never_executed(tmp_path):
    """The allow-listing unpickler refuses the crafted metadata on every reading path: verify, the DCP reader
    used by resume, and serving (which reads safetensors only)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dsaflow.checkpoint.store import newest_good_checkpoint, safe_load_metadata, safe_reader, verify_checkpoint
    from dsaflow.errors import CheckpointError

    marker = tmp_path / "PWNED"
    ck = crafted_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001", marker)
    with pytest.raises(CheckpointError, match="refusing to build posix.system|refusing to build os.system"):
        safe_load_metadata(ck / ".metadata")
    with pytest.raises(CheckpointError):
        verify_checkpoint(ck)
    skipped = []
    assert newest_good_checkpoint(tmp_path / "run", skipped.append) is None
    assert "step-000001" in skipped[0]
    with pytest.raises(BaseException):  # noqa: B017 - DCP wraps the reader's CheckpointError in its own type
        dcp.load({"x": torch.zeros(1)}, storage_reader=safe_reader(ck))
    assert not marker.exists()


def test_bytes_entries_in_metadata_are_refused(tmp_path):
    """DCP loads BytesStorageMetadata entries with torch.load(weights_only=False): a metadata that declares one is
    refused before any shard is read."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from dsaflow.checkpoint.store import safe_load_metadata
    from dsaflow.errors import CheckpointError

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"step": BytesStorageMetadata()})))
    with pytest.raises(CheckpointError, match="BytesStorageMetadata"):
        safe_load_metadata(tmp_path / ".metadata")


SUBPROCESS_CASES = [
    (["train", "train.lr=-1"], "train.lr=-1"),
    (["train", "track=online"], "wandb login"),  # checked before launch, within seconds, writing nothing
    (["generate", "serve.prompts=[hi]", "serve.checkpoint={files}/crafted"], "serve.checkpoint="),
    (["train", "train.resume=true", "run_dir={files}/crafted"], "no complete checkpoint"),
]


@pytest.mark.parametrize("argv,needle", SUBPROCESS_CASES, ids=[c[1] for c in SUBPROCESS_CASES])
def test_bad_inputs_through_the_real_cli(files, tmp_path, argv, needle):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), NETRC=str(tmp_path / "none"))
    args = [argv[0], *SMALL, *[a.format(files=files) for a in argv[1:]]]
    r = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert list(tmp_path.iterdir()) == [] and not (files / "PWNED").exists()


def test_run_dirs_are_unique_even_within_one_second(empty_cwd):
    """Two launches of the same config in the same second get two run dirs; neither writes into the other."""
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import write_run_dir

    cfg = compose(SMALL)
    plan = build_plan(cfg)
    dirs = {write_run_dir(cfg, plan, "t") for _ in range(3)}
    assert len(dirs) == 3 and all(d.parent == Path("runs") for d in dirs)
    assert sorted(p.name for p in next(iter(dirs)).iterdir()) == ["config.yaml", "plan.json", "plan.txt"]
    assert not [p for p in Path("runs").iterdir() if p.name.startswith(".")], "no temporary folder is left"
    gen = write_run_dir(cfg, plan, "t", job="generate")
    assert gen.parent == Path("runs") / "generate", "a generate run dir is not named like a training run"


def test_a_user_error_in_a_worker_exits_2_with_one_paragraph(tmp_path, capsys, monkeypatch):
    """The worker entry turns a PlanError (here: a run dir without config.yaml) into exit status 2, its message in
    <run_dir>/error-rank<r>.txt for the parent, and no traceback."""
    from dsaflow import worker

    as_torchrun_rank(monkeypatch, "1")
    monkeypatch.setattr("dsaflow.launch.lifecycle.die_with_parent", lambda *a: None)
    with pytest.raises(SystemExit) as e:
        worker.main([str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "config.yaml is missing" in err and "[rank 1]" in err and "Traceback" not in err
    assert "config.yaml is missing" in (tmp_path / "error-rank1.txt").read_text()


def test_weights_export_is_one_safetensors_file(tmp_path):
    from dsaflow.checkpoint.safetensors_io import load_tensors
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.checkpoint.weights import main as export_main
    from dsaflow.config.compose import compose
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import checkpoint_dir

    cfg = compose(["pipeline=pp2", *SMALL])
    plan = build_plan(cfg)
    stages = [stage_module(cfg.model, plan, s.index, seed=0) for s in plan.stages]
    save_checkpoint(checkpoint_dir(tmp_path, 2), stages, None, 0, 2)
    assert export_main(["export", str(tmp_path), str(tmp_path / "w.safetensors")]) == 0
    got = load_tensors(tmp_path / "w.safetensors")
    want = {k: v for m in stages for k, v in m.state_dict().items()}
    assert set(got) == set(want) and all(torch_equal(got[k], want[k]) for k in want)


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def test_resume_checks_in_the_parent(empty_cwd, capsys):
    """A run dir with a good checkpoint at step 1 of 2 passes every parent check (and nothing is written); at the
    final step it is refused as finished instead of re-saving its last checkpoint."""
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.config.compose import compose
    from dsaflow.launch.launch import check_launch
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan, render_table
    from dsaflow.rundir.folder import checkpoint_dir, write_run_dir

    cfg = compose([*SMALL, "run_dir=r"])
    plan = build_plan(cfg)
    write_run_dir(cfg, plan, render_table(plan, cfg))
    modules = [stage_module(cfg.model, plan, 0, seed=0)]
    save_checkpoint(checkpoint_dir("r", 1), modules, None, 0, 1)
    before = _snapshot(empty_cwd)
    resume = compose([*SMALL, "run_dir=r", "train.resume=true"])
    check_launch(resume, build_plan(resume))
    assert _snapshot(empty_cwd) == before
    save_checkpoint(checkpoint_dir("r", 2), modules, None, 0, 2)
    before = _snapshot(empty_cwd)
    assert cli.main(["train", *SMALL, "run_dir=r", "train.resume=true"]) == 2
    assert "already finished" in capsys.readouterr().err
    assert _snapshot(empty_cwd) == before
