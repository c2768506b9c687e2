"""Synthetic long-context retrieval: key-value pairs scattered through random filler, a query at the end.

One sample (bytes, `T + 1` long so that inputs are `[:-1]` and targets `[1:]`):

    qmzj xwv k:abc=v:417; pllr ... k:def=v:902; ... ?k:abc=v:417
                                                      ^query ^answer (value_len bytes, the last of the sample)

Keys are lowercase letters, values digits, filler lowercase letters and spaces (never `:`, `=`, `;`, `?`), so the
only way to predict the answer is to find the queried key earlier in the context and copy its value: the
associative-recall skill a sparse attention's indexer must keep reachable. Samples are a pure function of
(seed, split, step, row), which makes batches reproducible across ranks, restarts and pipeline layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
_DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)  # ~1 in 8 is a space


@dataclass(frozen=True)
class RetrievalSpec:
    seq_len: int  # model input length T
    num_pairs: int = 4
    key_len: int = 3
    value_len: int = 3

    @property
    def pair_len(self) -> int:  # "k:" key "=v:" value ";" plus a leading space
        return 1 + 2 + self.key_len + 3 + self.value_len + 1

    @property
    def query_len(self) -> int:  # "?k:" key "=v:" value
        return 3 + self.key_len + 3 + self.value_len

    def min_seq_len(self) -> int:
        return self.num_pairs * self.pair_len + self.query_len + 1

    def check(self) -> None:
        if self.key_len < 1 or self.value_len < 1 or self.num_pairs < 1:
            raise ValueError(
                f"data.num_pairs/key_len/value_len must be >= 1 (got {self.num_pairs}/{self.key_len}/"
                f"{self.value_len})."
            )
        if 26**self.key_len < self.num_pairs:
            raise ValueError(
                f"data.key_len={self.key_len} gives only {26 ** self.key_len} distinct keys for "
                f"data.num_pairs={self.num_pairs}; raise data.key_len."
            )
        if self.seq_len < self.min_seq_len():
            raise ValueError(
                f"train.seq_len={self.seq_len} cannot hold {self.num_pairs} pairs and the query "
                f"(needs >= {self.min_seq_len()}); raise train.seq_len or lower data.num_pairs."
            )


def retrieval_sample(spec: RetrievalSpec, rng: np.random.Generator) -> np.ndarray:
    """One sample: uint8 [T + 1]; the answer is the last `value_len` bytes."""
    total = spec.seq_len + 1
    out = rng.choice(_FILLER, size=total)
    keys = set()
    while len(keys) < spec.num_pairs:
        keys.add(bytes(rng.choice(_LETTERS, size=spec.key_len)))
    keys = sorted(keys)
    rng.shuffle(keys)
    values = [bytes(rng.choice(_DIGITS, size=spec.value_len)) for _ in keys]

    # Non-overlapping slots in the filler region: cut the free space into num_pairs + 1 random gaps.
    body = total - spec.query_len
    free = body - spec.num_pairs * spec.pair_len
    cuts = np.sort(rng.integers(0, free + 1, size=spec.num_pairs))
    pos = 0
    prev_cut = 0
    for i, (k, v) in enumerate(zip(keys, values)):
        pos += int(cuts[i] - prev_cut)
        prev_cut = int(cuts[i])
        text = b" k:" + k + b"=v:" + v + b";"
        out[pos : pos + spec.pair_len] = np.frombuffer(text, dtype=np.uint8)
        pos += spec.pair_len
    q = int(rng.integers(0, spec.num_pairs))
    query = b"?k:" + keys[q] + b"=v:" + values[q]
    out[total - spec.query_len :] = np.frombuffer(query, dtype=np.uint8)
    return out


def retrieval_batch(spec: RetrievalSpec, seed: int, split: int, step: int, batch: int) -> np.ndarray:
    """uint8 [batch, T + 1]; row r of step `step` depends only on (seed, split, step, r)."""
    rows = [retrieval_sample(spec, np.random.default_rng([seed, split, step, r])) for r in range(batch)]
    return np.stack(rows)
