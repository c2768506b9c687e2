"""Continuous batching on the host: which request sits in which cache row, and what the next pass of a group is.

The serving cache rows [0, serve.max_batch) are split into `groups` contiguous row ranges (microbatch groups). A
pass is one forward of one group through every stage: [rows, T] tokens, T = 1 when every active row of the group
decodes, else T = the longest prompt chunk in it (at most serve.prefill_chunk). In a pass each row either

- prefills the next chunk of its prompt (positions offset .. offset + t - 1; padded columns get position -1), and
  emits its first token when the chunk holds the last prompt token; or
- decodes: column 0 is its previous token (sampled on the device; stage 0 swaps it in), at position
  len(prompt) + generated - 1, and it emits one token; or
- is idle (every position -1: the row writes only the caches' trash row).

A row is freed when it reaches its own max_new_tokens (host-known) or emits EOS (known from the feedback flags that
every rank receives), and the next waiting request takes it at the group's next pass. Every rank runs this same
scheduler with the same inputs, so every rank builds the same passes without talking.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Sequence, Tuple


@dataclass
class Request:
    index: int  # position in the input (outputs come back in this order)
    prompt: List[int]
    max_new: int  # its own limit (the JSONL's max_new_tokens, else serve.max_new_tokens)


@dataclass
class Row:
    request: Request
    offset: int = 0  # prompt tokens already sent through the stages
    generated: int = 0  # tokens emitted so far


@dataclass
class Pass:
    """One group's forward. Host lists only; the engine turns them into device tensors.

    tokens, positions [rows][T]; decode[r]: row r's column 0 is its previous sampled token; emit: (row, column,
    request index, token index) of every row that samples a token in this pass."""

    group: int
    rows: int
    T: int
    tokens: List[List[int]]
    positions: List[List[int]]
    decode: List[bool]
    emit: List[Tuple[int, int, int, int]] = field(default_factory=list)
    decode_only: bool = False  # no row prefills: a decode step of the whole group


def group_ranges(max_batch: int, groups: int) -> List[Tuple[int, int]]:
    """Row ranges of the groups: max_batch rows as evenly as possible (the first groups take the remainder)."""
    base, extra = divmod(max_batch, groups)
    out, start = [], 0
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append((start, start + size))
        start += size
    return out


class Scheduler:
    """requests in input order; `next_pass(group)` admits waiting requests into free rows and builds the pass;
    `finish(pass, eos)` advances the rows (eos: per pass row, did it emit EOS; None when serve.eos_id is unset)."""

    def __init__(self, requests: Sequence[Request], ranges: Sequence[Tuple[int, int]], chunk: int,
                 refill: bool = True):
        self.queue: Deque[Request] = deque(requests)
        self.refill = refill  # False: fixed batches (a group takes requests only once all its rows finished)
        self.ranges, self.chunk = list(ranges), chunk
        self.rows: List[List[Optional[Row]]] = [[None] * (b - a) for a, b in self.ranges]
        self.generated = {r.index: 0 for r in requests}  # final token count per request
        self.finished = 0

    def has_work(self, group: int) -> bool:
        return bool(self.queue) or any(r is not None for r in self.rows[group])

    def next_pass(self, group: int) -> Optional[Pass]:
        rows = self.rows[group]
        if self.refill or all(r is None for r in rows):
            for i, r in enumerate(rows):
                if r is None and self.queue:
                    rows[i] = Row(self.queue.popleft())
        active = [i for i, r in enumerate(rows) if r is not None]
        if not active:
            return None
        n = active[-1] + 1
        prefilling = [i for i in active if rows[i].offset < len(rows[i].request.prompt)]
        T = max((min(self.chunk, len(rows[i].request.prompt) - rows[i].offset) for i in prefilling), default=1)
        tokens = [[0] * T for _ in range(n)]
        positions = [[-1] * T for _ in range(n)]
        decode = [False] * n
        p = Pass(group, n, T, tokens, positions, decode, decode_only=not prefilling)
        for i in active:
            row, req = rows[i], rows[i].request
            L = len(req.prompt)
            if row.offset < L:
                seg = req.prompt[row.offset : row.offset + T]
                tokens[i][: len(seg)] = seg
                positions[i][: len(seg)] = range(row.offset, row.offset + len(seg))
                if row.offset + len(seg) == L:
                    p.emit.append((i, len(seg) - 1, req.index, 0))
            else:
                decode[i] = True
                positions[i][0] = L + row.generated - 1
                p.emit.append((i, 0, req.index, row.generated))
        return p

    def finish(self, p: Pass, eos: Optional[Sequence[bool]] = None) -> List[int]:
        """Advance the rows of a pass that went through every stage -> indices of the requests that finished."""
        rows, done = self.rows[p.group], []
        emitted = {r for r, *_ in p.emit}
        for i in range(p.rows):
            row = rows[i]
            if row is None:
                continue
            row.offset = min(row.offset + p.T, len(row.request.prompt)) if not p.decode[i] else row.offset
            if i in emitted:
                row.generated += 1
                if row.generated >= row.request.max_new or (eos is not None and eos[i]):
                    self.generated[row.request.index] = row.generated
                    rows[i] = None
                    self.finished += 1
                    done.append(row.request.index)
        return done
