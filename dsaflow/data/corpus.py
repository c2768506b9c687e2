"""Token corpora read from disk, no download: text files/folders (byte tokens) and nanoGPT-style `.bin` files.

`.bin` follows nanoGPT's convention: a flat uint16 array of token ids, read with `np.memmap` (no header). A folder
is read as every file below it whose suffix is in `data.suffixes` (default `.txt`/`.md`/`.text`) and whose path
relative to the folder matches none of the `data.exclude` globs, in sorted order, joined with a newline.
Held out for evaluation (`data.split`): the last `val_fraction` of the tokens (`tail`), or whole files (`files`:
every file i of the sorted list with floor((i + 1) f) > floor(i f), f = val_fraction, so about f of the files, spread
evenly over the folders); training then never reads a byte of an evaluation file.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from dsaflow.errors import PlanError
from dsaflow.files import explain_os_error, kind_of

TEXT_SUFFIXES = (".txt", ".md", ".text")


class CorpusError(PlanError):
    """A data path mistake; the message names data.path and what to do."""


def text_files(path: Path, suffixes: Optional[Sequence[str]] = None, exclude: Sequence[str] = ()) -> List[Path]:
    """The files a text folder contributes, sorted (a single file: itself)."""
    if path.is_file():
        return [path]
    want = tuple(s.lower() for s in (suffixes or TEXT_SUFFIXES))
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in want
        and not any(fnmatch.fnmatchcase(p.relative_to(path).as_posix(), g) for g in exclude)
    )
    if not files:
        skip = f" outside data.exclude={list(exclude)}" if exclude else ""
        raise CorpusError(
            f"data.path={path} holds no {'/'.join(want)} files{skip}. Fix: point it at a text file or a folder of "
            "them, or set data.suffixes (e.g. data.suffixes=[.py])."
        )
    return files


def held_out(n_files: int, val_fraction: float) -> List[bool]:
    """Which of n sorted files `data.split=files` holds out: evenly spaced, floor(n * val_fraction) of them."""
    return [int((i + 1) * val_fraction) > int(i * val_fraction) for i in range(n_files)]


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


def resident_bytes(kind: str, path, suffixes=None, exclude=()) -> int:
    """Bytes of corpus every rank holds in memory: 0 for a single file (memory-mapped), the total size of a folder's
    text files (read and joined)."""
    p = Path(path).expanduser() if path else None
    if kind != "text" or p is None or not os.path.isdir(p):
        return 0
    try:
        return sum(f.stat().st_size + 1 for f in text_files(p, suffixes, exclude))
    except (CorpusError, OSError):
        return 0  # load_tokens names the problem


def load_tokens(kind: str, path: str | os.PathLike, suffixes=None, exclude=()) -> np.ndarray:
    """kind 'text' -> uint8 [N] bytes (a memmap for one file); kind 'bin' -> uint16 [N] memmap."""
    return load_split_tokens(kind, path, suffixes, exclude)[0]


def load_split_tokens(
    kind: str, path: str | os.PathLike, suffixes=None, exclude=(), val_fraction: Optional[float] = None
) -> Tuple[np.ndarray, Optional[int]]:
    """(tokens, split_at). val_fraction given (data.split=files, a text folder): the training files' bytes, then the
    held-out files' bytes, and split_at = where the held-out part starts; else (load_tokens' array, None)."""
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
        return _memmap(p, np.uint16, st), None
    if not stat.S_ISDIR(st.st_mode):
        if val_fraction is not None:
            raise CorpusError(
                f"data.split=files holds out whole files, but data.path={p} is one file. Fix: point data.path at a "
                "folder, or use data.split=tail."
            )
        return _memmap(p, np.uint8, st), None
    files = text_files(p, suffixes, exclude)
    if val_fraction is None:
        return _join(p, files), None
    out = held_out(len(files), val_fraction)
    train = _join(p, [f for f, o in zip(files, out) if not o])
    val = _join(p, [f for f, o in zip(files, out) if o])
    if val_fraction > 0 and not len(val):
        raise CorpusError(
            f"data.path={p}: data.split=files with data.val_fraction={val_fraction} holds out no file of the "
            f"{len(files)} read. Fix: raise data.val_fraction to at least {1 / len(files):.3g}, or use data.split=tail."
        )
    sep = np.frombuffer(b"\n", dtype=np.uint8) if len(train) and len(val) else np.zeros(0, np.uint8)
    return np.concatenate([train, sep, val]), len(train) + len(sep)


def _join(p: Path, files: List[Path]) -> np.ndarray:
    """uint8 [N]: the files' bytes joined with a newline."""
    chunks = []
    for f in files:
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

    def __init__(
        self, tokens: np.ndarray, seq_len: int, val_fraction: float, source: str, split_at: Optional[int] = None
    ):
        """split_at: where the held-out tokens start (data.split=files); None = the last val_fraction."""
        n = len(tokens)
        n_val = int(n * val_fraction) if split_at is None else n - split_at
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
