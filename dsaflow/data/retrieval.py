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

Answering needs a two-layer circuit (a previous-token head marks each value with its key; an induction head matches
the query key against those marks), and the few answer bytes give no gradient to either half until the other
exists: from scratch a small model sits at the no-matching accuracy for thousands of steps. `copy_len > 0` adds a
dense signal for the same circuit: a run of `copy_len` filler bytes appears a second time later in the filler, and
its second copy (from its second byte on) is a training target (`COPY` in the query ids), predictable only by
induction. The run is random filler, so it says nothing about any pair; accuracy still counts the queries alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsaflow.errors import PlanError

_KEYS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
_DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)  # ~1 in 8 is a space
_RUN_MIXED = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)
COPY = -2  # query id of a repeated filler byte: a training target (loss_on=answer), never an answer


@dataclass(frozen=True)
class RetrievalSpec:
    seq_len: int  # model input length T
    num_pairs: int = 4
    key_len: int = 2
    value_len: int = 2
    num_queries: int = 1  # queries at the end, keys drawn with replacement from the pairs (multi-query recall)
    distinct_queries: bool = False  # draw the queried pairs without replacement: no answer repeats an earlier one
    copy_len: int = 0  # > 0: a filler run of this many bytes repeated later in the filler, its repeat trained on
    copy_mixed: bool = False  # the run's bytes drawn from [a-zA-Z0-9] (the bytes keys and values use), not the filler's

    @property
    def pair_len(self) -> int:  # " " key value ";"
        return 1 + self.key_len + self.value_len + 1

    @property
    def query_len(self) -> int:  # "?" key value
        return 1 + self.key_len + self.value_len

    def min_seq_len(self) -> int:
        return self.num_pairs * self.pair_len + self.num_queries * self.query_len + 2 * self.copy_len

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
        if self.copy_len == 1 or self.copy_len < 0:
            raise PlanError(
                f"data.copy_len={self.copy_len}: a repeated run needs >= 2 bytes (its first byte is not predictable). "
                "Fix: set data.copy_len=0 (none) or 2 or more."
            )
        if self.seq_len < self.min_seq_len():
            copies = f" and a {self.copy_len}-byte run twice" if self.copy_len else ""
            raise PlanError(
                f"train.seq_len={self.seq_len} cannot hold {self.num_pairs} pairs and {self.num_queries} queries"
                f"{copies} (needs >= {self.min_seq_len()}). Fix: raise train.seq_len or lower data.num_pairs / "
                "data.num_queries / data.copy_len."
            )


def retrieval_sample(spec: RetrievalSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One sample: bytes uint8 [T + 1] and query ids int8 [T + 1] (q at the bytes of query q's answer, COPY at the
    trained bytes of the repeated run, else -1)."""
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
    is_filler = np.zeros(total, dtype=bool)
    is_filler[:body] = True
    for i, (k, v) in enumerate(zip(keys, values)):
        pos += int(cuts[i] - prev_cut)
        prev_cut = int(cuts[i])
        text = b" " + k + v + b";"
        out[pos : pos + spec.pair_len] = np.frombuffer(text, dtype=np.uint8)
        is_filler[pos : pos + spec.pair_len] = False
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
    if spec.copy_len:  # drawn last: samples without a copy keep their bytes
        _repeat_run(spec.copy_len, np.flatnonzero(is_filler), out, qid, rng, spec.copy_mixed)
    return out, qid


def _repeat_run(
    n: int, filler: np.ndarray, out: np.ndarray, qid: np.ndarray, rng: np.random.Generator, mixed: bool = False
) -> None:
    """Copy the bytes at filler[a : a + n] to filler[b : b + n] (b >= a + n; filler: the free positions, sorted) and
    mark each copied byte whose previous byte is copied too (both runs contiguous there) as a COPY target: a pair
    may sit inside either run, and a byte after it has no earlier context to be matched. `mixed` first redraws the
    run from letters of both cases and digits, so the circuit it trains also sees the bytes of keys and values; the
    run has no spaces and opens lowercase, so it never forms a ` K7` pair (a filler space may precede it)."""
    a = int(rng.integers(0, len(filler) - 2 * n + 1))
    b = int(rng.integers(a + n, len(filler) - n + 1))
    src, dst = filler[a : a + n], filler[b : b + n]
    if mixed:
        out[src] = rng.choice(_RUN_MIXED, size=n)
        out[src[0]] = rng.choice(_RUN_MIXED[:26])
    out[dst] = out[src]
    joined = (np.diff(src) == 1) & (np.diff(dst) == 1)
    qid[dst[1:][joined]] = COPY


def retrieval_batch(spec: RetrievalSpec, seed: int, split: int, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """bytes uint8 [batch, T + 1], query ids int8 [batch, T + 1]; row r of step `step` depends only on
    (seed, split, step, r)."""
    rows = [retrieval_sample(spec, np.random.default_rng([seed, split, step, r])) for r in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
