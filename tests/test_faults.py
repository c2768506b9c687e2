"""Fault injection (CPU, gloo): kill the parent, torchrun or a worker at a random point of a `dsaflow train` with
two ranks, interrupt checkpoint saves, corrupt checkpoints. Afterwards nothing of the run is left running, every
checkpoint folder that exists is good, and resume continues from the newest good checkpoint with the losses of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_harness import TINY_PP2_RUN, run_configs, stop_and_resume_cfgs, tiny_cfg

from dsaflow.checkpoint.store import newest_good_checkpoint, verify_checkpoint
from dsaflow.launch.lifecycle import children
from dsaflow.rundir.folder import list_checkpoints, read_metrics

ROOT = Path(__file__).resolve().parents[1]
LONG_RUN = [
    *TINY_PP2_RUN,
    "train.steps=100000",
    "train.ckpt_every=1",
    "train.keep_checkpoints=2",
]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the process tree")
@pytest.mark.parametrize(
    "victim,sig",
    [("parent", signal.SIGINT), ("parent", signal.SIGKILL), ("torchrun", signal.SIGKILL), ("worker", signal.SIGKILL)],
)
def test_a_single_kill_leaves_nothing_running(tmp_path, victim, sig):
    rng = random.Random(f"{victim}-{sig}")  # the kill point is random but replayable
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    parent = subprocess.Popen(
        [sys.executable, "-m", "dsaflow.cli", "train", *LONG_RUN, f"run_dir={run}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        need = rng.randint(2, 3)  # step 1's checkpoint is complete once step 2 is logged
        _wait(lambda: len(read_metrics(run)) >= need or parent.poll() is not None, 240, f"{need} logged steps")
        assert parent.poll() is None, parent.communicate()[1][-3000:]
        time.sleep(rng.uniform(0, 0.5))
        agent = _wait(lambda: children(parent.pid), 30, "torchrun")[0]
        workers = _wait(lambda: len(children(agent)) == 2 and children(agent), 30, "two workers")
        tree = [parent.pid, agent, *workers]
        target = {"parent": parent.pid, "torchrun": agent, "worker": workers[-1]}[victim]
        os.kill(target, sig)
        out, err = parent.communicate(timeout=60)
        _wait(lambda: not any(_alive(p) for p in tree), 20, f"every process of {tree} to end")
    finally:
        if parent.poll() is None:
            parent.kill()
    if victim == "parent" and sig == signal.SIGINT:
        assert parent.returncode == 130, err
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and "interrupted (SIGINT)" in lines[0], err
    else:
        assert parent.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    for _, folder in list_checkpoints(run):  # a kill during a save leaves at most a partial folder
        verify_checkpoint(folder)
    assert newest_good_checkpoint(run) is not None


def _flip_byte(path: Path, offset: int = -9) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _break_checkpoints(i: int, cfg) -> None:
    """Before the resumed run (config 2): flip a byte in step 4's shard and leave an interrupted save of step 5."""
    if i != 2:
        return
    run = Path(cfg.run_dir)
    _flip_byte(sorted((run / "checkpoints" / "step-000004").glob("*.distcp"))[0])
    partial = run / "checkpoints" / ".step-000005.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 10)


@pytest.mark.slow
def test_resume_skips_bad_checkpoints_and_matches_an_uninterrupted_run(tmp_path):
    """Checkpoints at steps 2 and 4; step 4's shard gets a flipped byte and a save of step 5 was interrupted (its
    partial folder is left). Resume names step 4 as bad, falls back to step 2, and logs the losses of a run that
    was never interrupted."""
    common = dict(steps=5, ckpt_every=2, dense_warmup_steps=1, keep_checkpoints=5)
    full, stopped, resumed = stop_and_resume_cfgs(tmp_path, 2, 2, "1F1B", 4, **common)
    _, r_stopped, r_resumed = run_configs(2, [full, stopped, resumed], tmp_path / "out", _break_checkpoints)
    run = Path(stopped.run_dir)
    assert [h["step"] for h in r_stopped["history"]] == [1, 2, 3, 4]
    assert [h["step"] for h in r_resumed["history"]] == [3, 4, 5], "resume must fall back to step 2"
    want = [r["loss"] for r in read_metrics(full.run_dir)]
    assert [r["loss"] for r in read_metrics(run)] == want, "resumed losses differ from the uninterrupted run"
    log = (run / "train.log").read_text()
    assert "skipping checkpoint" in log and "step-000004" in log and "sha256" in log
    assert not (run / "checkpoints" / ".step-000005.partial").exists(), "a later save clears partial folders"
    assert [s for s, _ in list_checkpoints(run)][0] == 5


def test_interrupted_save_leaves_no_checkpoint_and_existing_ones_are_never_rewritten(tmp_path, monkeypatch):
    """A save killed at any point before its rename leaves only `.step-N.partial`; newest_good falls back to the
    previous checkpoint; saving over an existing checkpoint is a no-op; truncation and deletion are detected."""
    from dsaflow.checkpoint import training_state as ck
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import checkpoint_dir

    cfg = tiny_cfg(1, None, "1F1B")
    modules = [stage_module(cfg.model, build_plan(cfg), 0, seed=0)]
    run = tmp_path / "run"
    assert ck.save_checkpoint(checkpoint_dir(run, 1), modules, None, 0, 1)
    first = {p.name: p.read_bytes() for p in checkpoint_dir(run, 1).iterdir()}
    with torch.no_grad():
        modules[0].head.weight.add_(1.0)
    assert not ck.save_checkpoint(checkpoint_dir(run, 1), modules, None, 0, 1), "an existing checkpoint is kept"
    assert {p.name: p.read_bytes() for p in checkpoint_dir(run, 1).iterdir()} == first

    def killed(*a, **k):
        raise KeyboardInterrupt  # the process dies between the shards and the manifest

    monkeypatch.setattr(ck, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(checkpoint_dir(run, 2), modules, None, 0, 2)
    monkeypatch.undo()
    assert not checkpoint_dir(run, 2).exists() and (run / "checkpoints" / ".step-000002.partial").is_dir()
    assert newest_good_checkpoint(run)[0] == 1

    assert ck.save_checkpoint(checkpoint_dir(run, 3), modules, None, 0, 3, keep=5)
    assert not (run / "checkpoints" / ".step-000002.partial").exists()
    st = checkpoint_dir(run, 3) / "model-rank0.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size - 4)
    msgs = []
    assert newest_good_checkpoint(run, msgs.append)[0] == 1 and "truncated" in msgs[0]
    (checkpoint_dir(run, 1) / "model-rank0.safetensors").unlink()
    assert newest_good_checkpoint(run, msgs.append) is None and "missing" in msgs[-1]


def test_keep_prunes_to_the_newest_checkpoints(tmp_path):
    from dsaflow.checkpoint.training_state import save_checkpoint
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import checkpoint_dir

    cfg = tiny_cfg(1, None, "1F1B")
    modules = [stage_module(cfg.model, build_plan(cfg), 0, seed=0)]
    for step in range(1, 5):
        save_checkpoint(checkpoint_dir(tmp_path, step), modules, None, 0, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 3]
    manifest = json.loads((checkpoint_dir(tmp_path, 4) / "manifest.json").read_text())
    assert set(manifest["files"]) >= {".metadata", "model-rank0.safetensors"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the process tree")
def test_a_second_launch_is_refused_and_a_stopped_worker_is_named_and_given_up(tmp_path):
    """While a run trains, a resume of its run dir is refused naming the running launch (the lock). Then a worker
    is stopped (SIGSTOP): the parent names it within seconds and the run ends within launch.timeout_s plus the
    time to stop, with no traceback, nothing left running and every checkpoint good."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    timeout_s = 10
    parent = subprocess.Popen(
        [sys.executable, "-m", "dsaflow.cli", "train", *LONG_RUN, f"run_dir={run}", f"launch.timeout_s={timeout_s}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait(lambda: len(read_metrics(run)) >= 2 or parent.poll() is not None, 240, "2 logged steps")
        assert parent.poll() is None, parent.communicate()[1][-3000:]
        second = subprocess.run(
            [sys.executable, "-m", "dsaflow.cli", "train", *LONG_RUN, f"run_dir={run}", "train.resume=true"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert f"is in use by `dsaflow train` (pid {parent.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        agent = _wait(lambda: children(parent.pid), 30, "torchrun")[0]
        workers = _wait(lambda: len(children(agent)) == 2 and children(agent), 30, "two workers")
        tree = [parent.pid, agent, *workers]
        os.kill(workers[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, err = parent.communicate(timeout=timeout_s + 60)
        took = time.monotonic() - stopped_at
        _wait(lambda: not any(_alive(p) for p in tree), 20, f"every process of {tree} to end")
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode != 0
    assert took < timeout_s + 30, f"the run ended {took:.0f} s after the stop (launch.timeout_s={timeout_s})"
    assert "is stopped (SIGSTOP or a debugger)" in err and "launch.timeout_s=10" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for _, folder in list_checkpoints(run):
        verify_checkpoint(folder)
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == sorted(set(steps)), "the refused launch must not have logged anything"


def test_gloo_timeouts_are_recognised_as_a_lost_peer():
    """What gloo raises once launch.timeout_s has passed (seen with torch 2.13: a recv, then a collective): the
    worker reports a lost peer in one line instead of a traceback."""
    from dsaflow.worker import _lost_peer

    for text in (
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete",
        "Application timeout caused pair closure",
    ):
        assert _lost_peer(RuntimeError(text)), text
    assert not _lost_peer(RuntimeError("shape mismatch"))
