"""Token corpora read from disk, no download: text files/folders (byte tokens) and nanoGPT-style `.bin` files.

`.bin` follows nanoGPT's convention: a flat uint16 array of token ids, read with `np.memmap` (no header). A folder
is read as every `*.txt`/`*.md` file below it in sorted order, joined with a newline. The last `val_fraction` of the
tokens is held out for evaluation.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

import numpy as np

from dsaflow.errors import PlanError

TEXT_SUFFIXES = (".txt", ".md", ".text")


class CorpusError(PlanError):
    """A data path mistake; the message names data.path and what to do."""


def text_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise CorpusError(f"data.path={path} holds no {'/'.join(TEXT_SUFFIXES)} files. Fix: point it at a text file or a folder of them.")
    return files


def load_tokens(kind: str, path: str | os.PathLike) -> np.ndarray:
    """kind 'text' -> uint8 [N] bytes; kind 'bin' -> uint16 [N] memmap."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusError(f"data.path={p} does not exist. Fix: set data.path to an existing {'text file/folder' if kind == 'text' else '.bin token file'}.")
    if kind == "bin":
        if not p.is_file():
            raise CorpusError(f"data.kind=bin needs a file, but data.path={p} is a folder. Fix: point data.path at the .bin file.")
        if p.stat().st_size % 2:
            raise CorpusError(f"data.path={p} has an odd size, so it is not a flat uint16 array. Fix: use a nanoGPT-style .bin (np.uint16 tokens).")
        return np.memmap(p, dtype=np.uint16, mode="r")
    chunks = [np.fromfile(f, dtype=np.uint8) for f in text_files(p)]
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
