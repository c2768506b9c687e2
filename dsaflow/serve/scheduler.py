"""Continuous batching on the host: which request sits in which cache row, and what the next pass of a group is.

The serving cache rows [0, serve.max_batch) are split into `groups` contiguous row ranges (microbatch groups). A
pass is one forward of one group through every stage, of one of two kinds:

- decode: [rows, 1], one token for every decoding row (column 0: its previous token, sampled on the device; stage 0
  swaps it in) at position len(prompt) + generated - 1; rows [0, last decoding row], the others idle (position -1,
  which writes only the caches' trash row);
- prefill: [rows, T], the next prompt chunk of the prefilling rows (T = their longest chunk, at most
  serve.prefill_chunk; shorter chunks pad with position -1), over the span of rows they occupy; a row whose chunk
  holds its last prompt token samples its first token.

When a group has rows of both kinds, its passes either alternate (eager prefill: a pass costs what its rows x tokens
cost, so a narrow prefill pass and a decode step are cheaper than one wide pass), or, with `mixed` (prefill through
the group's graph, whose static [rows, T] shape costs the same whatever its rows do), every pass is both: the
decoding rows put their one token in column 0 of the prefill pass and sample from it, so they never wait.

A row is freed when it reaches its own max_new_tokens (host-known) or emits EOS. EOS is known from the flags the last
stage sends with the tokens, and it is applied one pass of the group late (`end`, at the group's next `finish`): the
group's next pass is built before the flags can reach the host, so the GPUs never wait on that read, and a row that
emitted EOS computes one more token, which is dropped. Once a quarter of the group's rows are free (or enough for
every waiting request), waiting requests take them at the group's next pass (longest first, in the lowest rows) and
prefill together. Every rank runs this same scheduler with the same inputs, so every rank builds the same passes
without talking.

With `narrow` (continuous batching), a refill rearranges the group's rows (the pass's `moves`, applied to every
stage's cache rows before the pass runs there): decoding rows to the lowest rows, so a decode pass's span holds no
finished row, then every row that still prefills, the joining requests included, up to the top row, least prompt
left lowest. Once no request waits, the group is compacted the same way whenever a quarter of its decode span is
idle (`_sparse`), so the drain at the end of a run does not compute the holes its finished rows leave. Every
prefill pass then covers a top-aligned span [first prefilling row, group rows): eagerly it costs those rows, and a
prefill graph captured over the top c rows of the group serves it at the cost of c rows, not of
the whole group. Decode passes run between prefill passes as usual. Given the prefill graphs' token classes
(`chunk_classes`), a pass takes the class that prefills the most tokens per unit of cost (`_chunk_for`), so the short
prompts of a refill end in a short pass instead of being padded to the longest one's chunk.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Container, Deque, Dict, List, Optional, Sequence, Tuple

from .mixed import mixed_pass
from .passes import Pass, Request, Row
from .speculative_engine import verify_pass


def prefill_row_classes(group_rows: int) -> Tuple[int, ...]:
    """Row counts of the top-aligned prefill graphs of a group (`narrow`): 1/32, 1/16, ..., 1/2 of its rows and all
    of them, ascending; a refill of n requests prefills at the cost of the smallest class >= n. The small classes
    matter once the refill share is 1/4: a pass's last chunks often hold a few long prompts only."""
    return tuple(sorted({max(1, group_rows // d) for d in (32, 16, 8, 4, 2, 1)}))


def online_arrivals(arrivals: Optional[Sequence[float]], n: int, one_process: bool) -> Optional[List[float]]:
    """The arrival times of n requests (seconds after the run starts) as floats, or ValueError naming what is wrong:
    one per request, >= 0, non-decreasing in input order (requests join in order), and every stage in this process
    (the ranks of a pipeline decide admissions each on its own, and wall-clock arrivals would make them disagree)."""
    if arrivals is None:
        return None
    arrivals = [float(a) for a in arrivals]
    if len(arrivals) != n:
        raise ValueError(f"arrivals: {len(arrivals)} times for {n} prompts; give one per prompt")
    if any(a < 0 for a in arrivals) or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrivals must be seconds >= 0, non-decreasing in input order (requests join in order)")
    if not one_process:
        raise ValueError(
            "arrivals need every stage in this process: ranks decide admissions each on its own, from their inputs "
            "alone, and wall-clock arrivals would make them disagree; serve online arrivals with all_stages=True or "
            "pipeline=single"
        )
    return arrivals


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
    `finish(pass)` advances the rows; `end(pass, eos)` frees the rows whose token in that pass was EOS."""

    # refill a group once this share of its rows is free: lower keeps more rows decoding, higher makes fewer and
    # wider prefill passes (1/4 against 1/2: 1.08x output tokens/s on the mixed workload on an H200, docs/serving.md)
    REFILL_FRACTION = 0.25
    SPAN_DENSITY = 0.5  # a prefill pass spans all prefilling rows when they fill at least this share of the span
    # A prefill graph pass's fixed cost in row-tokens of prefill: 1.7 ms of launches against 0.7 us per row-token
    # (model=small on an H200, scripts/bench_serve.py). It weighs a short chunk class, which ends the short prompts
    # of a refill without padding them to the longest, against a long one, which needs fewer passes.
    PASS_COST_TOKENS = 2400

    def __init__(
        self,
        requests: Sequence[Request],
        ranges: Sequence[Tuple[int, int]],
        chunk: int,
        refill: bool = True,
        mixed: bool = False,
        narrow: bool = False,
        chunk_classes: Sequence[int] = (),
        balance: bool = False,
        max_pass_tokens: Optional[int] = None,
        arrivals: Optional[Sequence[float]] = None,
        speculative_tokens: int = 0,
    ):
        self.speculative_tokens = speculative_tokens  # > 0: decoding rows run verify passes (speculative_engine)
        self.queue: Deque[Request] = deque(requests)
        # online arrivals (`online_arrivals`): request i joins the queue once clock() reaches arrivals[i]; until then
        # it is pending
        self.pending: Deque[Tuple[float, Request]] = deque()
        self.arrivals = arrivals
        if arrivals is not None:
            self.pending, self.queue = deque(zip(arrivals, requests)), deque()
        self.started = time.perf_counter()  # clock() counts from here; `start_clock` resets it as the run starts
        self.turn_group = 0  # `pick`'s round robin over the groups
        # serve.max_pass_tokens: mixed token-major passes (dsaflow.serve.mixed) with this token budget; continuous
        # batching only, and then none of the narrow refills, chunk classes or balanced chunks below
        self.max_pass_tokens = max_pass_tokens if refill else None
        if self.max_pass_tokens is not None:
            narrow, chunk_classes, balance = False, (), False
        self.refill = refill  # False: fixed batches (a group takes requests only once all its rows finished)
        self.mixed = mixed  # prefill passes carry the decoding rows too (see the module docstring)
        self.narrow = narrow and refill and not mixed  # compact on refill, joiners in the top rows (module docstring)
        self.ranges, self.chunk = list(ranges), chunk
        # narrow passes through prefill graphs: their token classes (a pass pads to one), see `_chunk_for`
        self.chunk_classes = sorted(c for c in chunk_classes if c <= chunk) if self.narrow else []
        # eager passes whose cost follows their rows x tokens, groups in flight together: size prefill chunks like
        # the other groups' decode passes (`_chunk_for`). Narrow passes only: fixed batches prefill a whole group,
        # in contiguous runs once short prompts end, and balanced chunks there served 0.82x the tokens/s (pp2, two
        # groups, mixed workload, 2-core CPU: 1,509 against 1,832)
        self.balance = balance and self.narrow and not self.chunk_classes
        self.rows: List[List[Optional[Row]]] = [[None] * (b - a) for a, b in self.ranges]
        self.generated = {r.index: 0 for r in requests}  # final token count per request
        self.turn = ["prefill"] * len(self.ranges)  # which kind a group runs next when it has both
        self.finished = 0

    def has_work(self, group: int) -> bool:
        self._arrive()
        return bool(self.queue) or bool(self.pending) or any(r is not None for r in self.rows[group])

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def clock(self) -> float:
        """Seconds since the run started (`start_clock`): the time arrivals are given in."""
        return time.perf_counter() - self.started

    def pick(self, busy: Container[int]) -> Optional[Pass]:
        """The next pass of the groups in turn (round robin) whose previous pass is done (not in `busy`), or None
        when none has one. With requests still to arrive and nothing in flight, first waits for the next one."""
        groups = len(self.ranges)
        while True:
            self._arrive()
            for k in range(groups):
                g = (self.turn_group + k) % groups
                if g in busy or not (self.queue or self.pending or any(r is not None for r in self.rows[g])):
                    continue
                p = self.next_pass(g)
                if p is not None:
                    self.turn_group = g + 1
                    return p
            due = self.pending[0][0] if self.pending else None
            if due is None or any(g in busy for g in range(groups)):
                return None  # the end, or a bubble while passes are in flight
            time.sleep(max(0.0, due - self.clock()))  # nothing to run or in flight until the next request arrives

    def from_arrival(self, ttft: Dict[int, float]) -> Dict[int, float]:
        """{request: time to first token from the start} -> from each request's arrival (online; else as it is)."""
        return ttft if self.arrivals is None else {r: v - self.arrivals[r] for r, v in ttft.items()}

    def _arrive(self) -> None:
        """Pending requests whose arrival time has come join the queue, in input order."""
        if self.pending:
            now = self.clock()
            while self.pending and self.pending[0][0] <= now:
                self.queue.append(self.pending.popleft()[1])

    def next_pass(self, group: int) -> Optional[Pass]:
        self._arrive()
        rows = self.rows[group]
        free = sum(r is None for r in rows)
        # refill once REFILL_FRACTION of the group is free (or every waiting request fits): the joining requests
        # prefill together, instead of one narrow prefill pass (and one paused decode step) per finished row
        wanted = min(max(1, int(len(rows) * self.REFILL_FRACTION)), len(self.queue))
        moves: List[Tuple[int, int]] = []
        active = [i for i, r in enumerate(rows) if r is not None] if self.narrow else []
        sparse_holes = max(1, int((active[-1] + 1) * self.REFILL_FRACTION)) if active else 0
        if self.max_pass_tokens is not None and self.queue and free:
            # mixed passes: a joining row costs the decoding rows no paused step, so every free row takes the next
            # request at once (lowest rows first, no moves); its prompt waits for room in the token budget
            for i in [i for i, r in enumerate(rows) if r is None][: len(self.queue)]:
                rows[i] = Row(self.queue.popleft())
        elif self.narrow and self.queue and free >= max(wanted, 1):
            joining = [Row(self.queue.popleft()) for _ in range(min(free, len(self.queue)))]
            moves = self._compact(rows, joining)
        elif self.narrow and not self.queue and active and active[-1] + 1 - len(active) >= sparse_holes:
            # REFILL_FRACTION or more of a decode pass's span (rows up to the last active one) is idle. Narrow
            # refills place rows by prompt length, not by when they finish, so once the queue is empty finished
            # rows leave holes that every later decode pass still computes; compacting at this density bounds the
            # waste at 1 / (1 - REFILL_FRACTION) of the active rows, in a few moves as the group drains.
            moves = self._compact(rows, [])  # nothing left to join: close the holes a decode pass would compute
        elif (self.refill and free >= max(wanted, 1)) or free == len(rows):
            slots = [i for i, r in enumerate(rows) if r is None][: len(self.queue)]
            joining = [self.queue.popleft() for _ in slots]
            # the longest remaining work takes the lowest rows, so the span a decode pass covers (rows up to the
            # last active one) shrinks as requests finish
            for i, req in zip(slots, sorted(joining, key=lambda q: -(len(q.prompt) + q.max_new))):
                rows[i] = Row(req)
        p = self._build(group)
        if p is not None and moves:
            rows = self.rows[group]
            p.moves = moves
            p.move_len = max(rows[k].offset + rows[k].generated for _, k in moves)
        return p

    @staticmethod
    def _compact(rows: List[Optional[Row]], joining: List[Row]) -> List[Tuple[int, int]]:
        """Narrow refill: decoding rows to the lowest rows (in order), then every row that still prefills, the
        joining ones included, up to the top row, least prompt left lowest (so the top-aligned prefill span shrinks
        as prompts end). Fills `rows` in place -> the (from, to) moves of the rows that were already there."""
        active = [i for i, r in enumerate(rows) if r is not None]
        prefilling = [i for i in active if rows[i].offset < len(rows[i].request.prompt)]
        decoding = [i for i in active if i not in set(prefilling)]
        top = sorted(
            [*((rows[i], i) for i in prefilling), *((r, None) for r in joining)],
            key=lambda e: len(e[0].request.prompt) - e[0].offset,
        )
        order = [(rows[i], i) for i in decoding] + [(None, None)] * (len(rows) - len(decoding) - len(top)) + top
        rows[:] = [r for r, _ in order]
        return [(i, k) for k, (_, i) in enumerate(order) if i is not None and i != k]

    def _build(self, group: int) -> Optional[Pass]:
        rows = self.rows[group]
        active = [i for i, r in enumerate(rows) if r is not None]
        if not active:
            return None
        prefilling = [i for i in active if rows[i].offset < len(rows[i].request.prompt)]
        decoding = [i for i in active if i not in set(prefilling)]
        if prefilling and self.max_pass_tokens is not None:
            return mixed_pass(group, rows, self.max_pass_tokens, self.chunk)
        if prefilling and self.mixed:
            return self._prefill_pass(group, prefilling, decoding)
        # both kinds waiting: alternate, so decoding rows keep going while a joining request prefills
        if prefilling and (not decoding or self.turn[group] == "prefill"):
            self.turn[group] = "decode"
            return self._prefill_pass(group, prefilling)
        self.turn[group] = "prefill"
        return self._decode_pass(group, decoding)

    def _decode_pass(self, group: int, decoding: List[int]) -> Pass:
        """One token for every decoding row: rows [0, last decoding row], the others idle (with speculation, the
        last token and the drafts of every decoding row: `verify_pass`)."""
        if self.speculative_tokens:
            return verify_pass(group, self.rows[group], decoding, self.speculative_tokens)
        rows, n = self.rows[group], decoding[-1] + 1
        p = Pass(group, 0, n, 1, [[0] for _ in range(n)], [[-1] for _ in range(n)], [False] * n, decode_only=True)
        for i in decoding:
            req = rows[i].request
            p.decode[i] = True
            p.positions[i][0] = len(req.prompt) + rows[i].generated - 1
            p.emit.append((i, 0, req.index, rows[i].generated))
        return p

    def _prefill_pass(self, group: int, prefilling: List[int], decoding: Sequence[int] = ()) -> Pass:
        """The next chunk of the prefilling rows: their span when at least half of it prefills, else their first
        contiguous run (so decoding rows between them cost little padding). Given `decoding` rows (mixed passes),
        the pass starts at row 0 and covers them too: each puts its previous token in column 0."""
        rows = self.rows[group]
        a, b = prefilling[0], prefilling[-1] + 1
        if self.mixed:  # the group's graph covers rows [0, group rows) anyway
            a, b = 0, max([b, *(i + 1 for i in decoding)])
        elif self.narrow:  # top-aligned (a graph over the group's top rows, or an eager pass over them)
            b = len(rows)
        elif len(prefilling) < self.SPAN_DENSITY * (b - a):
            b = a
            while b in prefilling:
                b += 1
        span = [i for i in prefilling if a <= i < b]
        chunk = self._chunk_for([len(rows[i].request.prompt) - rows[i].offset for i in span], b - a, group)
        T = max(min(chunk, len(rows[i].request.prompt) - rows[i].offset) for i in span)
        n = b - a
        p = Pass(group, a, n, T, [[0] * T for _ in range(n)], [[-1] * T for _ in range(n)], [False] * n)
        for i in span:
            row, req = rows[i], rows[i].request
            seg = req.prompt[row.offset : row.offset + T]
            r = i - a
            p.tokens[r][: len(seg)] = seg
            p.positions[r][: len(seg)] = range(row.offset, row.offset + len(seg))
            p.advance[r] = row.offset + len(seg)
            if row.offset + len(seg) == len(req.prompt):
                p.emit.append((r, len(seg) - 1, req.index, 0))
        for i in decoding:
            req = rows[i].request
            p.decode[i] = True
            p.positions[i][0] = len(req.prompt) + rows[i].generated - 1
            p.emit.append((i, 0, req.index, rows[i].generated))
        return p

    def _chunk_for(self, left: List[int], rows: int, group: int) -> int:
        """The chunk of a prefill pass of `group` over `rows` rows whose prompts have `left` tokens to go:
        serve.prefill_chunk; with `chunk_classes`, the class that prefills the most tokens per unit of cost
        (PASS_COST_TOKENS + rows x class), so that a refill's short prompts finish in a short pass before the long
        ones go on; with `balance`, about as many row-tokens as the other groups' decode passes hold.

        Why balance: with groups in flight, a tick lasts as long as its longest pass, so a prefill pass that costs
        four decode passes keeps the rank that runs a decode pass beside it idle for three. Eagerly on a CPU a pass
        costs about its rows x tokens, so a chunk of (their decode rows / rows) tokens costs about what they do."""
        if self.balance:
            decode_rows = [n for h in range(len(self.rows)) if h != group and (n := self._decode_rows(h))]
            if decode_rows:
                return max(1, min(self.chunk, round(sum(decode_rows) / len(decode_rows) / rows)))
        if not self.chunk_classes:
            return self.chunk
        return max(self.chunk_classes, key=lambda c: sum(min(n, c) for n in left) / (self.PASS_COST_TOKENS + rows * c))

    def _decode_rows(self, group: int) -> int:
        """Rows a decode pass of `group` covers now (up to its last decoding row; 0 when none decodes)."""
        rows = self.rows[group]
        return next((i + 1 for i in reversed(range(len(rows))) if self._decoding(rows[i])), 0)

    @staticmethod
    def _decoding(row: Optional[Row]) -> bool:
        return row is not None and row.offset >= len(row.request.prompt)

    def finish(self, p: Pass) -> List[int]:
        """Advance the rows of a pass that went through every stage -> indices of the requests that finished (at
        their own max_new_tokens). A row that `end` freed after this pass was built (EOS in the group's previous
        pass) sampled a token past its end: that token is dropped, and `p.emit` keeps only the tokens that count."""
        rows, done, kept = self.rows[p.group], [], []
        for r, offset in p.advance.items():
            if rows[p.row0 + r] is not None:  # a row cancelled while its pass was in flight (online serving)
                rows[p.row0 + r].offset = offset
        for e in p.emit:
            r, _, req, _ = e
            row = rows[p.row0 + r]
            if row is None or row.request.index != req:
                continue
            kept.append(e)
            row.generated += 1
            if row.generated >= row.request.max_new:
                done.append(self._free(p.group, p.row0 + r))
        p.emit = kept
        return done

    def end(self, p: Pass, eos: Sequence[bool]) -> List[int]:
        """Apply the EOS flags of a finished pass (eos[r]: pass row r sampled serve.eos_id) -> indices of the
        requests that end there. Called one pass late (at the group's next `finish`), so a row may have moved (a
        compacting refill) or already ended at its max_new_tokens: rows are found by request."""
        rows, done = self.rows[p.group], []
        for r, _, req, _ in p.emit:
            if not eos[r]:
                continue
            i = next((i for i, row in enumerate(rows) if row is not None and row.request.index == req), None)
            if i is not None:
                done.append(self._free(p.group, i))
        return done

    def _free(self, group: int, i: int) -> int:
        """Row i of the group is done: record its token count, free it -> its request index."""
        row = self.rows[group][i]
        self.generated[row.request.index] = row.generated
        self.rows[group][i] = None
        self.finished += 1
        return row.request.index
