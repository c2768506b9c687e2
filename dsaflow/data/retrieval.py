"""Synthetic long-context retrieval: key-value pairs scattered through random filler, a query at the end.

One sample (bytes, `T + 1` long so that inputs are `[:-1]` and targets `[1:]`):

    qmzj xwv KQ41; pllr ... DF90; ... ?KQ41?DF90
                                      ^query, ^answer (value_len bytes); num_queries queries end the sample

Keys are uppercase letters, values digits, filler lowercase letters and spaces (never `;` or `?`), so the only way
to predict the answer is to find the queried key earlier in the context and copy the digits that follow it: the
associative-recall (induction) skill a sparse attention's indexer must keep reachable. With `distinct_queries`
every query asks a different pair, so no answer can be copied from an earlier query near the end: each needs its
pair, wherever the filler put it. Ask at most half the pairs, though: when every pair is asked, the last answers
follow by elimination (the values no earlier query took), a shortcut that needs no key matching. The format is
deliberately terse (no `k:`/`=v:` markers): the value directly follows its key, the classic one-hop induction pattern that a
small model picks up in minutes, where every extra marker byte adds a hop. Samples are a pure function of
(seed, split, step, row), which makes batches reproducible across ranks, restarts and pipeline layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsaflow.errors import PlanError

_KEYS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
_DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)  # ~1 in 8 is a space


@dataclass(frozen=True)
class RetrievalSpec:
    seq_len: int  # model input length T
    num_pairs: int = 4
    key_len: int = 2
    value_len: int = 2
    num_queries: int = 1  # queries at the end, keys drawn with replacement from the pairs (multi-query recall)
    distinct_queries: bool = False  # draw the queried pairs without replacement: no answer repeats an earlier one

    @property
    def pair_len(self) -> int:  # " " key value ";"
        return 1 + self.key_len + self.value_len + 1

    @property
    def query_len(self) -> int:  # "?" key value
        return 1 + self.key_len + self.value_len

    def min_seq_len(self) -> int:
        return self.num_pairs * self.pair_len + self.num_queries * self.query_len

    def check(self) -> None:
        if min(self.key_len, self.value_len, self.num_pairs, self.num_queries) < 1:
            raise PlanError(
                f"data.num_pairs/num_queries/key_len/value_len must be >= 1 (got {self.num_pairs}/{self.num_queries}/"
                f"{self.key_len}/{self.value_len}). Fix: set each to 1 or more."
            )
        if 26**self.key_len < self.num_pairs:
            raise PlanError(
                f"data.key_len={self.key_len} gives only {26**self.key_len} distinct keys for "
                f"data.num_pairs={self.num_pairs}. Fix: raise data.key_len."
            )
        if self.distinct_queries and self.num_queries > self.num_pairs:
            raise PlanError(
                f"data.distinct_queries=true needs data.num_queries <= data.num_pairs (got {self.num_queries} > "
                f"{self.num_pairs}). Fix: lower data.num_queries, raise data.num_pairs, or set data.distinct_queries=false."
            )
        if self.seq_len < self.min_seq_len():
            raise PlanError(
                f"train.seq_len={self.seq_len} cannot hold {self.num_pairs} pairs and {self.num_queries} queries "
                f"(needs >= {self.min_seq_len()}). Fix: raise train.seq_len or lower data.num_pairs / data.num_queries."
            )


def retrieval_sample(spec: RetrievalSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One sample: bytes uint8 [T + 1] and query ids int8 [T + 1] (q at the bytes of query q's answer, else -1)."""
    total = spec.seq_len + 1
    out = rng.choice(_FILLER, size=total)
    qid = np.full(total, -1, dtype=np.int8)
    keys = set()
    while len(keys) < spec.num_pairs:
        keys.add(bytes(rng.choice(_KEYS, size=spec.key_len)))
    keys = sorted(keys)
    rng.shuffle(keys)
    values = [bytes(rng.choice(_DIGITS, size=spec.value_len)) for _ in keys]

    # Non-overlapping slots in the filler region: cut the free space into num_pairs + 1 random gaps.
    body = total - spec.num_queries * spec.query_len
    free = body - spec.num_pairs * spec.pair_len
    cuts = np.sort(rng.integers(0, free + 1, size=spec.num_pairs))
    pos = 0
    prev_cut = 0
    for i, (k, v) in enumerate(zip(keys, values)):
        pos += int(cuts[i] - prev_cut)
        prev_cut = int(cuts[i])
        text = b" " + k + v + b";"
        out[pos : pos + spec.pair_len] = np.frombuffer(text, dtype=np.uint8)
        pos += spec.pair_len
    pos = body
    if spec.distinct_queries:
        picks = rng.permutation(spec.num_pairs)[: spec.num_queries]
    else:
        picks = rng.integers(0, spec.num_pairs, size=spec.num_queries)
    for q, pick in enumerate(picks):
        query = b"?" + keys[pick] + values[pick]
        out[pos : pos + spec.query_len] = np.frombuffer(query, dtype=np.uint8)
        qid[pos + spec.query_len - spec.value_len : pos + spec.query_len] = q
        pos += spec.query_len
    return out, qid


def retrieval_batch(spec: RetrievalSpec, seed: int, split: int, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """bytes uint8 [batch, T + 1], query ids int8 [batch, T + 1]; row r of step `step` depends only on
    (seed, split, step, r)."""
    rows = [retrieval_sample(spec, np.random.default_rng([seed, split, step, r])) for r in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
