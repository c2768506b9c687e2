"""One process tree per run dir: an exclusive lock taken by every launch that writes into a run dir.

`<run_dir>/.lock` is locked with `flock` (the kernel releases it when the holder exits, however it exits: Linux NFS
clients map it to POSIX locks that every client sees) and holds `{"pid", "host", "job", "since"}` of the holder, so
a second launch is refused with a message naming the process that has the run. A record whose lock is free was left
by a process that ended (killed, or its host lost): it is stale, reported with its pid and host, and overwritten.

Who takes it: the `dsaflow train|generate` parent (for its whole launch, workers included), and rank 0 of a launch
started without that parent (`launch/multi_node.sh`, torchrun by hand). Readers of checkpoints (serving) do not take
it: they pin the checkpoint they read (dsaflow.checkpoint.store.pinned).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from dsaflow.errors import PlanError
from dsaflow.files import MissingFile, UnsafeFile, parse_json, read_bytes

LOCK = ".lock"
LOCK_ENV = "DSAFLOW_RUN_DIR_LOCKED"  # set for the children of the process that holds the lock


class RunDirBusy(PlanError):
    """Another process has the run dir."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(path: Path) -> Optional[dict]:
    try:
        rec = parse_json(read_bytes(path, inside=path.parent, max_bytes=4096), str(path), max_depth=2)
    except (MissingFile, UnsafeFile):
        return None
    return rec if isinstance(rec, dict) else None


def _describe(rec: Optional[dict]) -> str:
    if not rec:
        return "another process"
    t = rec.get("since")
    since = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) and 0 < t < 1e11 else "?"
    )
    return f"`dsaflow {rec.get('job', '?')}` (pid {rec.get('pid')} on host {rec.get('host')}, since {since})"


def _busy(run_dir: Path, rec: Optional[dict]) -> RunDirBusy:
    return RunDirBusy(
        f"run_dir={run_dir} is in use by {_describe(rec)}; two launches never share a run dir (they would mix "
        "checkpoints and metrics). Fix: wait for that run to end (or stop it), or use another run_dir."
    )


@contextmanager
def run_dir_lock(run_dir: str | Path, job: str, report=None):
    """Hold the run dir's lock for the `with` block; raises RunDirBusy naming the holder. `report(msg)` hears of a
    stale record taken over."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise PlanError(
            f"run_dir={run_dir}: cannot open its lock file {path} ({exc.strerror}); a link or another "
            "kind of file there is refused. Fix: remove it, or use another run_dir."
        ) from None
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            raise PlanError(f"run_dir={run_dir}: {path} is not a regular file. Fix: remove it.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run_dir, _holder(path)) from None
        rec = _holder(path)
        if rec and not rec.get("released") and report is not None:
            alive = (
                rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int) and _pid_alive(rec["pid"])
            )
            report(
                f"run_dir={run_dir}: taking over a stale lock of {_describe(rec)}, which ended without releasing "
                f"it{' (that pid now belongs to another process)' if alive else ''}"
            )
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "job": job, "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        try:
            yield
        finally:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({**mine, "released": time.time()}).encode(), 0)
            except OSError:
                pass
    finally:
        os.close(fd)  # releases the flock


def lock_held_by_parent(run_dir: str | Path) -> bool:
    """True in a process started (through torchrun) by the process that holds this run dir's lock."""
    try:
        return os.environ.get(LOCK_ENV) == str(Path(run_dir).resolve())
    except OSError:
        return False


def check_fresh_start(run_dir: str | Path, cfg, job: str) -> None:
    """A training launch that does not resume must find its run dir untrained: a second start of a prepared run dir
    (launch/multi_node.sh run twice) would retrain from step 0 into the same metrics and checkpoints."""
    if job != "train" or cfg.train.resume:
        return
    from .folder import METRICS, list_checkpoints

    run_dir = Path(run_dir)
    steps = [s for s, _ in list_checkpoints(run_dir)]
    logged = os.path.lexists(run_dir / METRICS) and os.lstat(run_dir / METRICS).st_size > 0
    if steps or logged:
        what = f"checkpoints up to step {max(steps)}" if steps else "logged metrics"
        raise PlanError(
            f"run_dir={run_dir} already holds a trained run ({what}), and its config.yaml does not resume, so this "
            "launch would train again from step 0 into the same metrics. Fix: to continue it, prepare it with "
            "train.resume=true (and a larger train.steps if it finished); otherwise use a new run_dir."
        )


@contextmanager
def claim_run_dir(run_dir: str | Path, cfg, job: str, rank: int):
    """What a worker does before joining the process group: refuse a second start of a trained run dir, and on
    rank 0 of a launch that no `dsaflow` parent holds, take the run dir's lock for the whole job."""
    check_fresh_start(run_dir, cfg, job)
    if rank != 0 or lock_held_by_parent(run_dir):
        yield
        return
    with run_dir_lock(run_dir, job):
        yield
