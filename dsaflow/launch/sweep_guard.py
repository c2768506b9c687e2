"""What keeps a sweep (`dsaflow COMMAND -m ...`) its own and stoppable.

* Its folder: an explicit `hydra.sweep.dir` that already holds a sweep (multirun.yaml, a summary, job folders) is
  refused before anything starts, and the sweep holds the folder's lock (dsaflow.rundir.lock) until it ends, so two
  sweeps never mix their jobs, summaries or metrics. (The default folder is new: runs/multirun/<time>.)
* A stop: SIGINT, SIGTERM or SIGHUP ends the running job as a single run would (the launcher stops its process
  tree and says so in one line), then `Interrupted` (dsaflow.launch.interrupts, a KeyboardInterrupt) leaves
  Hydra's job loop, which catches only `Exception`, so no further job starts; the summary lists the jobs that
  did not run.
* Its checks: every distinct value of each swept key is composed once (two per key for long numeric ranges: the
  smallest and the largest) instead of every combination, with a progress line when that takes a while; each job
  is composed in full when it runs, and Hydra checks one job at a time (`hydra.sweeper.max_batch_size=1`).
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Dict, List, Optional

from dsaflow.errors import ConfigError

from .interrupts import STOP_SIGNALS, Interrupted

SWEEP_FILES = ("multirun.yaml", "summary.md", "summary.csv")
MANY_VALUES = 16  # a key with more distinct numeric values is checked at its two ends


def explicit_sweep_dir(overrides: List[str]) -> Optional[str]:
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key == "hydra.sweep.dir" and value:
            return value
    return None


@contextmanager
def hold_sweep_dir(overrides: List[str]):
    """Refuse an explicit sweep dir that holds another sweep; hold its lock for the `with` block."""
    from dsaflow.rundir.lock import LOCK, RunDirBusy, run_dir_lock

    where = explicit_sweep_dir(overrides)
    if where is None:
        yield
        return
    folder = Path(where)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"hydra.sweep.dir={where} is not a folder. Fix: choose another hydra.sweep.dir.")
    held = [p.name for p in folder.iterdir() if p.name != LOCK] if folder.is_dir() else []
    if held:
        what = "another sweep" if any(n in SWEEP_FILES for n in held) else "other files"
        raise ConfigError(
            f"hydra.sweep.dir={where} already holds {what} ({', '.join(sorted(held)[:4])}); a sweep writes job "
            "folders 0, 1, ..., multirun.yaml and its summary there, and would mix them with what is there. "
            "Fix: choose a new hydra.sweep.dir (or leave it unset for runs/multirun/<time>). Nothing was started."
        )
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        try:
            stack.enter_context(run_dir_lock(folder, "sweep"))
        except RunDirBusy as exc:
            raise ConfigError(
                f"hydra.sweep.dir={where} is in use by another sweep ({str(exc).split(' is in use by ', 1)[-1]}"
            ) from None
        yield


def after_job(exit_code: int) -> None:
    """A job the user interrupted (exit status 128 + a stop signal; the launcher said so) ends the sweep."""
    if exit_code in {128 + s for s in STOP_SIGNALS}:
        raise Interrupted(exit_code - 128)


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def representative_jobs(jobs: List[List[str]]) -> List[List[str]]:
    """A few jobs that together hold every distinct value of every swept key (for a key with more than MANY_VALUES
    numeric values, its smallest and largest): composing these finds a bad value without composing every job."""
    first_job_of: Dict[tuple, int] = {}
    for i, job in enumerate(jobs):
        for ov in job:
            first_job_of.setdefault(tuple(ov.split("=", 1)) if "=" in ov else (ov, ""), i)
    by_key: Dict[str, List[tuple]] = {}
    for kv in first_job_of:
        by_key.setdefault(kv[0], []).append(kv)
    picked = {0} if jobs else set()
    for kvs in by_key.values():
        nums = [_number(v) for _, v in kvs]
        if len(kvs) > MANY_VALUES and all(n is not None for n in nums):
            order = sorted(range(len(kvs)), key=lambda j: nums[j])
            kvs = [kvs[order[0]], kvs[order[-1]]]
        picked.update(first_job_of[kv] for kv in kvs)
    return [jobs[i] for i in sorted(picked)]


def check_jobs(jobs: List[List[str]], compose, say=None) -> None:
    """Compose the representative jobs (raises the first ConfigError), saying how far it got every 2 s."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    reps = representative_jobs(jobs)
    last = time.monotonic()
    for n, job in enumerate(reps, start=1):
        compose(job)
        if time.monotonic() - last > 2.0:
            say(f"checking the sweep: {n}/{len(reps)} distinct values of {len(jobs)} jobs composed")
            last = time.monotonic()


def not_run(jobs: List[List[str]], done: int, result_type) -> list:
    """Summary rows for the jobs after the first `done` that a stop left unrun."""
    return [result_type(n, list(job), None, "not run", -1) for n, job in enumerate(jobs) if n >= done]


def is_basic_sweeper(overrides: List[str]) -> bool:
    return not any(
        o.lstrip("+~").split("=", 1)[0] == "hydra/sweeper" and o.split("=", 1)[1] != "basic" for o in overrides
    )


def one_job_at_a_time(overrides: List[str]) -> List[str]:
    """Hydra's basic sweeper composes every job of a batch before the first starts: batches of one."""
    if is_basic_sweeper(overrides) and not any(o.startswith("hydra.sweeper.max_batch_size=") for o in overrides):
        return [*overrides, "hydra.sweeper.max_batch_size=1"]
    return overrides
