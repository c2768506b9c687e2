"""Token corpora read from disk, no download: text files/folders (byte tokens) and nanoGPT-style `.bin` files.

`.bin` follows nanoGPT's convention: a flat uint16 array of token ids, read with `np.memmap` (no header). A folder
is read as every `*.txt`/`*.md` file below it in sorted order, joined with a newline. The last `val_fraction` of the
tokens is held out for evaluation.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import List

import numpy as np

from dsaflow.errors import PlanError
from dsaflow.files import explain_os_error, kind_of

TEXT_SUFFIXES = (".txt", ".md", ".text")


class CorpusError(PlanError):
    """A data path mistake; the message names data.path and what to do."""


def text_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise CorpusError(
            f"data.path={path} holds no {'/'.join(TEXT_SUFFIXES)} files. Fix: point it at a text file or a folder of them."
        )
    return files


def _stat(p: Path, kind: str) -> os.stat_result:
    want = "text file/folder" if kind == "text" else ".bin token file"
    try:
        return os.stat(p)
    except FileNotFoundError:
        raise CorpusError(f"data.path={p} does not exist. Fix: set data.path to an existing {want}.") from None
    except OSError as exc:
        raise CorpusError(
            f"data.path={str(p)[:200]} {explain_os_error(exc)}. Fix: set data.path to a readable {want}."
        ) from None


def _memmap(p: Path, dtype, st: os.stat_result) -> np.ndarray:
    """A read-only map of a regular file (nothing is loaded: a corpus of any size costs no memory up front)."""
    if not stat.S_ISREG(st.st_mode):
        raise CorpusError(
            f"data.path={p} is {kind_of(st.st_mode)}, not a regular file. Fix: point data.path at a "
            "file (a FIFO or a device cannot be sampled at random)."
        )
    if st.st_size == 0:
        raise CorpusError(f"data.path={p} is empty (0 bytes). Fix: point data.path at a file that holds tokens.")
    try:
        return np.memmap(p, dtype=dtype, mode="r")
    except OSError as exc:
        raise CorpusError(
            f"data.path={p} {explain_os_error(exc)}. Fix: make it readable, or use another file."
        ) from None


def resident_bytes(kind: str, path) -> int:
    """Bytes of corpus every rank holds in memory: 0 for a single file (memory-mapped), the total size of a folder's
    text files (read and joined)."""
    p = Path(path).expanduser() if path else None
    if kind != "text" or p is None or not os.path.isdir(p):
        return 0
    try:
        return sum(f.stat().st_size + 1 for f in text_files(p))
    except (CorpusError, OSError):
        return 0  # load_tokens names the problem


def load_tokens(kind: str, path: str | os.PathLike) -> np.ndarray:
    """kind 'text' -> uint8 [N] bytes (a memmap for one file); kind 'bin' -> uint16 [N] memmap."""
    p = Path(path).expanduser()
    st = _stat(p, kind)
    if kind == "bin":
        if stat.S_ISDIR(st.st_mode):
            raise CorpusError(
                f"data.kind=bin needs a file, but data.path={p} is a folder. Fix: point data.path at the .bin file."
            )
        if stat.S_ISREG(st.st_mode) and st.st_size % 2:
            raise CorpusError(
                f"data.path={p} has an odd size, so it is not a flat uint16 array. Fix: use a nanoGPT-style .bin (np.uint16 tokens)."
            )
        return _memmap(p, np.uint16, st)
    if not stat.S_ISDIR(st.st_mode):
        return _memmap(p, np.uint8, st)
    chunks = []
    for f in text_files(p):
        try:
            chunks.append(np.fromfile(f, dtype=np.uint8))
        except OSError as exc:
            raise CorpusError(
                f"data.path={p}: {f} {explain_os_error(exc)}. Fix: make it readable, or move it out of the folder."
            ) from None
    sep = np.frombuffer(b"\n", dtype=np.uint8)
    joined: List[np.ndarray] = []
    for i, c in enumerate(chunks):
        if i:
            joined.append(sep)
        joined.append(c)
    return np.concatenate(joined) if joined else np.zeros(0, np.uint8)


class TokenCorpus:
    """Random windows of `seq_len + 1` tokens; window starts are a pure function of (seed, split, step, row)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, source: str):
        n = len(tokens)
        n_val = int(n * val_fraction)
        self.tokens, self.seq_len = tokens, seq_len
        self.ranges = {0: (0, n - n_val), 1: (n - n_val, n)}
        for split, (lo, hi) in self.ranges.items():
            if hi - lo < seq_len + 1 and not (split == 1 and val_fraction == 0):
                what = "training" if split == 0 else "validation (data.val_fraction)"
                raise CorpusError(
                    f"data.path={source}: the {what} part has {hi - lo} tokens, fewer than train.seq_len + 1 = "
                    f"{seq_len + 1}. Fix: use more data, a shorter train.seq_len or a different data.val_fraction."
                )
        if val_fraction == 0:
            self.ranges[1] = self.ranges[0]  # evaluate on training windows rather than on nothing

    def batch(self, seed: int, split: int, step: int, batch: int) -> np.ndarray:
        """int64 [batch, T + 1]."""
        lo, hi = self.ranges[split]
        rng = np.random.default_rng([seed, split, step])
        starts = rng.integers(lo, hi - self.seq_len, size=batch)
        return np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
