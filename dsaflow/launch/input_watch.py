"""Inputs that change under a running job are named: a memory-mapped data file truncated or rewritten while the
workers read it kills them with SIGBUS ("signal 7" in torchrun's report), which says nothing of the file.

The parent records the identity of each input file (size, modification time, inode) before the workers start and
compares afterwards; a changed file gets one line naming it and what changed.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

Identity = Tuple[int, int, int]


def _identity(path: str) -> Optional[Identity]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def snapshot(cfg, job: str) -> Dict[str, Tuple[str, Optional[Identity]]]:
    """{field: (path, identity)} of the job's input files (data.path when it is one file: the workers map it)."""
    out = {}
    path = cfg.data.path
    if job == "train" and path and os.path.isfile(os.path.expanduser(path)):
        p = os.path.expanduser(path)
        out["data.path"] = (p, _identity(p))
    return out


def changed_inputs(before: Dict[str, Tuple[str, Optional[Identity]]]) -> List[str]:
    """One line per input file that changed since `snapshot`."""
    lines = []
    for field, (path, was) in before.items():
        now = _identity(path)
        if now == was:
            continue
        if now is None:
            what = "was removed"
        elif now[2] != was[2]:
            what = "was replaced by another file"
        elif now[0] != was[0]:
            what = f"changed size from {was[0]} to {now[0]} bytes"
        else:
            what = "was rewritten"
        lines.append(
            f"{field}={path} {what} while the job ran; the workers read it memory-mapped, so a truncated file stops "
            "them with SIGBUS (signal 7) and a rewritten one mixes old and new data. Fix: leave the data file "
            "unchanged during a run (write a new file and point data.path at it)."
        )
    return lines
