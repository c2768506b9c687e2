"""One process tree: every process of a launch dies with its parent, and the parent can stop the whole tree.

    dsaflow (parent) --Popen, new session--> agent (torchrun in-process) --Popen, new session--> worker x ranks

Each child asks the kernel for SIGKILL when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere a watchdog
thread polls the parent pid), so a kill of any single process never leaves an orphan training to the end: killing
the parent takes the agent, killing the agent takes the workers, and a dead worker makes torchrun stop its peers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import List

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask to receive `sig` when the parent process exits; exit at once if it already has."""
    parent = os.getppid()
    done = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            done = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            done = False
    if not done:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, name="dsaflow-parent-watch", daemon=True).start()
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def children(pid: int) -> List[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out


def descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> int:
    """Send `sig` to `pid` and every descendant (found before the first signal); returns how many were signalled."""
    pids = [pid] + descendants(pid)
    n = 0
    for p in reversed(pids):
        try:
            os.kill(p, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def exit_now(code: int) -> None:
    """End this process with `code` once its work is done, without the interpreter's teardown: the atexit handlers
    run (logging's flush and close, wandb's), Python's and C's standard streams are flushed, then `os._exit`. The
    teardown that is skipped only frees memory, and with torch loaded it takes 1-2 s per process (1.7 s for a
    worker's imports on a 2-core CPU), which every `dsaflow train` paid once per rank and once for the agent. Files
    the code wrote are closed by then (context managers, the metrics logger's close)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
                pass
        try:
            ctypes.CDLL(None).fflush(None)  # C-level stdio buffers (torch's C++ prints)
        except (OSError, AttributeError):
            pass
        os._exit(code)
