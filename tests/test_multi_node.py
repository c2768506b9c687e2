"""Two node agents on 127.0.0.1 with gloo, started through launch/multi_node.sh exactly as on a cluster (one
process per node, a pipeline of two ranks). Both nodes finish; a node left alone gives up with one clear line
within launch.timeout_s; starting a finished run dir again is refused (nothing retrained, nothing rewritten), and
preparing it again with train.resume=true continues it. Pipeline x data parallelism across the two nodes (pp2 x
dp2, each node one whole pipeline) trains the losses of the same run on one node of 4 processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_harness import TINY_PP2_RUN, free_port

from dsaflow.checkpoint.store import verify_checkpoint
from dsaflow.rundir.folder import list_checkpoints, read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "multi_node.sh"
TIMEOUT_S = 20  # launch.timeout_s of the runs that rendezvous
# the missing-node test waits out its whole timeout: a shorter one there (the rule it checks, one clear line once
# launch.timeout_s has passed, is the same at any length); the runs that must rendezvous keep TIMEOUT_S
MISSING_TIMEOUT_S = 6

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash launcher, Linux process rules"),
]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DSAFLOW_PARENT")}
    env.update(PYTHONPATH=str(ROOT), PYTHON=sys.executable, PYTHONUNBUFFERED="1", **extra)
    return env


def prepare(run_dir: Path, *overrides: str, timeout_s: int = TIMEOUT_S) -> Path:
    tiny = [*TINY_PP2_RUN, f"launch.timeout_s={timeout_s}"]
    r = subprocess.run(
        [sys.executable, "-m", "dsaflow.launch.launch", "prepare", *tiny, *overrides, f"run_dir={run_dir}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def start_nodes(run_dir: Path, ranks=(0, 1), nnodes: int = 2, nproc_per_node: int = 1):
    env = _env(
        RUN_DIR=str(run_dir),
        NNODES=str(nnodes),
        NPROC_PER_NODE=str(nproc_per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return [
        subprocess.Popen(
            ["bash", str(SCRIPT)],
            env={**env, "NODE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=run_dir.parent,
        )
        for r in ranks
    ]


def finish(nodes, timeout: float):
    out = []
    try:
        for p in nodes:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    return out


def _snapshot(run: Path) -> dict:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock" and not p.name.startswith("error-rank")
    }


def test_two_nodes_finish_and_a_rerun_is_refused_then_resumes(tmp_path):
    run = prepare(tmp_path / "run", "train.steps=3")
    for rc, _out, err in finish(start_nodes(run), 240):
        assert rc == 0, err[-3000:]
        assert "Traceback" not in err and "waiting for 2 nodes at the rendezvous" in err, err[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(run)] == [3]
    verify_checkpoint(list_checkpoints(run)[0][1])

    before = _snapshot(run)
    for rc, _out, err in finish(start_nodes(run), 120):  # the same script, the same run dir, again
        assert rc == 2, err[-3000:]
        assert "already holds a trained run (checkpoints up to step 3)" in err and "train.resume=true" in err, err
    assert _snapshot(run) == before, "a refused rerun must not retrain or rewrite anything"

    assert prepare(run, "train.steps=4", "train.resume=true") == run
    for rc, _out, err in finish(start_nodes(run), 240):
        assert rc == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(run)][0] == 4


def test_a_missing_node_is_a_clear_error_within_the_timeout(tmp_path):
    run = prepare(tmp_path / "run", "train.steps=3", timeout_s=MISSING_TIMEOUT_S)
    before = _snapshot(run)
    t0 = time.monotonic()
    [(rc, out, err)] = finish(start_nodes(run, ranks=(0,)), MISSING_TIMEOUT_S + 60)
    took = time.monotonic() - t0
    assert rc == 1, err
    assert took < MISSING_TIMEOUT_S + 20, f"gave up after {took:.0f} s with launch.timeout_s={MISSING_TIMEOUT_S}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("dsaflow: waiting for 2 nodes at the rendezvous 127.0.0.1:"), err
    assert "the rendezvous failed" in lines[-1] and f"giving up after {MISSING_TIMEOUT_S} s" in lines[-1], err
    assert "Fix:" in lines[-1] and "Traceback" not in err, err
    assert _snapshot(run) == before


def test_pp2_x_dp2_over_two_nodes_trains_as_on_one_node(tmp_path):
    ppdp = ("parallel.dp=2", "train.steps=3")
    two = prepare(tmp_path / "two", *ppdp)
    for rc, _out, err in finish(start_nodes(two, nproc_per_node=2), 240):
        assert rc == 0 and "Traceback" not in err, err[-3000:]
    one = prepare(tmp_path / "one", *ppdp)
    for rc, _out, err in finish(start_nodes(one, ranks=(0,), nnodes=1, nproc_per_node=4), 240):
        assert rc == 0, err[-3000:]
    losses = [[r["loss"] for r in read_metrics(run)] for run in (two, one)]
    assert len(losses[0]) == 3 and len(set(losses[0])) == 3, losses  # three steps, and the loss moves
    assert losses[0] == losses[1], "the same ranks on two nodes must compute what they compute on one"
    verify_checkpoint(list_checkpoints(two)[0][1])
