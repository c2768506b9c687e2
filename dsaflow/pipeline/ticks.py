"""The ticks of a pipelined forward: which segment runs which pass at tick t, what moves between ranks after it,
and how long each rank computed (the `Timeline`).

Used by the serving engine (dsaflow/serve/engine.py), evaluation and the dense warm-up
(dsaflow/train/forward_pass.py), each with a straight loop of its own; the training schedules (forward + backward)
are torch.distributed.pipelining's, not this.

The stages are cut into *segments*: maximal runs of consecutive stages owned by one rank (a rank running every stage
has one segment; pp2 has two; an interleaved pp2 with four stages has four). Every rank walks the same ticks:

    tick t:  segment j runs the pass that started at tick t - j (one pass per segment per tick)
             then one batch of point-to-point ops: each segment's output to the next segment's rank, and the last
             segment's feedback (serving: the sampled tokens + EOS flags) to the ranks that read it, all posted
             together with the receives of the next tick (`PipelineSchedule.transfers`), so sends around a ring
             never deadlock

A pass belongs to a *group*: a pass whose group is still in flight cannot start (serving: its first stage needs the
tokens its group's previous pass sampled on the last stage). With G groups and K segments, G >= K keeps every
segment busy every tick in steady state, and G = 1 leaves each rank idle (K-1)/K of the time.

`PipelineSchedule` is pure bookkeeping over host-known facts: every rank builds the same passes in the same ticks,
so every rank posts matching operations without talking. A pass is any object with these attributes:
`group`, `start` (set here), `hidden` / `hidden_dtype` (the activation between segments, [rows, tokens, dim]),
`extra` ((shape, dtype) of each tensor that travels with it where `carries(stage)` says so: cross-stage indices),
`feedback` (the int64 message the last segment sends back, or None), `decode_only`, `token_major`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

Segment = Tuple[int, List[int]]  # (rank, its consecutive stages)
TransferKey = Tuple[int, int, int]  # (start tick of the pass, receiving segment or -1 for feedback, part)


def segments_of(owner: Dict[int, int]) -> List[Segment]:
    """{stage: rank} -> [(rank, [stages])] runs of consecutive stages on one rank, in stage order."""
    segs: List[Segment] = []
    for s in sorted(owner):
        if segs and segs[-1][0] == owner[s]:
            segs[-1][1].append(s)
        else:
            segs.append((owner[s], [s]))
    return segs


class PipelineSchedule:
    """The passes in flight on this rank's view of the pipeline, keyed by the tick they started.

    owner: {stage: pipeline rank}; rank: this process's pipeline rank; peer: pipeline rank -> global rank, the
    address of a transfer (identity by default); carries(stage): whether the boundary after `stage` carries each
    pass's `extra` tensors (default: none does); feedback_ranks: the pipeline ranks that receive each pass's feedback
    (default: every rank; the last segment's rank always has it). A message nobody reads is not sent: a transfer
    costs every rank on its path host time each tick."""

    def __init__(
        self,
        owner: Dict[int, int],
        rank: int,
        peer: Optional[Callable[[int], int]] = None,
        carries: Optional[Callable[[int], bool]] = None,
        feedback_ranks: Optional[Sequence[int]] = None,
    ):
        self.segments = segments_of(owner)
        self.K = len(self.segments)
        self.rank = rank
        self.mine = [j for j, (r, _) in enumerate(self.segments) if r == rank]
        self.last_rank = self.segments[-1][0]
        ranks = sorted({r for r, _ in self.segments})
        self.feedback_ranks = sorted(set(ranks if feedback_ranks is None else feedback_ranks) | {self.last_rank})
        unknown = set(self.feedback_ranks) - set(ranks)
        if unknown:
            raise ValueError(f"PipelineSchedule: feedback_ranks {sorted(unknown)} run no stage.")
        peer = peer or (lambda r: r)
        carries = carries or (lambda stage: False)
        # per segment, fixed for the run: where its output goes, whether that boundary carries `extra`, whence its
        # input comes
        self.next_peer = [peer(self.segments[j + 1][0]) if j + 1 < self.K else None for j in range(self.K)]
        self.prev_peer = [peer(self.segments[j - 1][0]) if j > 0 else None for j in range(self.K)]
        self.carries = [carries(stages[-1]) for _, stages in self.segments]
        self.feedback_peers = [peer(r) for r in self.feedback_ranks if r != rank]
        self.reads_feedback = rank != self.last_rank and rank in self.feedback_ranks
        self.last_peer = peer(self.last_rank)
        self.in_flight: Dict[int, Any] = {}  # start tick -> pass
        self.busy_groups: set = set()  # groups with a pass in flight: their next pass waits
        self.decoding = False  # every pass in flight this tick is a decode step (`begin`)
        self.inbox: Dict[Tuple[int, int], Any] = {}  # (start tick, segment) -> the input it received (`deliver`)

    def begin(self, t: int, p=None) -> List[Tuple[int, Any, Any]]:
        """Tick t: pass p (if any) starts on segment 0 -> [(segment, pass, what it received)] of this rank's
        segments now, in segment order; what segment 0 receives is None (it reads its own input)."""
        if p is not None:
            p.start = t
            self.in_flight[t] = p
            self.busy_groups.add(p.group)
        # the same on every rank; verify passes (speculative decoding) are the decode steps of their rows
        self.decoding = all(q.decode_only or getattr(q, "speculative", False) for q in self.in_flight.values())
        return [
            (j, self.in_flight[t - j], self.inbox.pop((t - j, j), None)) for j in self.mine if (t - j) in self.in_flight
        ]

    def deliver(self, keys: Sequence[TransferKey], received: Sequence[torch.Tensor], message=None):
        """File one tick's received tensors (in the order of `transfers`' keys) as the inputs of this rank's
        segments -> the feedback message received this tick, else `message` (the last segment's own)."""
        for (start, j, part), buf in zip(keys, received):
            if j == -1:
                message = buf
            elif part == 0:
                self.inbox[(start, j)] = buf
            else:  # extra tensors follow their activation, in part order
                prev = self.inbox[(start, j)]
                self.inbox[(start, j)] = (*(prev if isinstance(prev, tuple) else (prev,)), buf)
        return message

    def any_token_major(self) -> bool:
        return any(p.token_major for p in self.in_flight.values())

    def leave(self, t: int):
        """The pass that left the pipeline at tick t (its last segment ran now), or None; its group is free again."""
        p = self.in_flight.pop(t - (self.K - 1), None)
        if p is not None:
            self.busy_groups.discard(p.group)
        return p

    def transfers(self, t: int, outputs: List[Tuple[int, Any, Any]], message) -> Tuple[list, List[TransferKey]]:
        """One tick's point-to-point operations, in the canonical order both sides of every pair build alike (start
        tick, then activations before feedback, each activation followed by its extra tensors) -> (ops, the key of
        each receive in op order).

        outputs: [(segment, pass, output)] of this rank's segments this tick; an output is a tensor, or a tuple
        (hidden, *extra) where the boundary carries extras; the last segment's output is not sent (its `message`
        goes to the feedback ranks). ops: ("send", tensor, global rank, declared shape) | ("recv", (shape, dtype),
        global rank), the format of `p2p.post_tick` and `TransferGraphs`."""
        ops: List[Tuple[Tuple[int, int, int], tuple]] = []
        for j, p, out in outputs:
            if j + 1 < self.K:
                parts = out if isinstance(out, tuple) else (out,)
                dst = self.next_peer[j]
                ops.append(((p.start, 0, 0), ("send", parts[0].to(p.hidden_dtype), dst, p.hidden)))
                if self.carries[j] and p.extra:
                    for e, (part, (shape, _)) in enumerate(zip(parts[1:], p.extra), start=1):
                        ops.append(((p.start, 0, e), ("send", part, dst, shape)))
            elif message is not None and p.feedback is not None:
                for dst in self.feedback_peers:
                    ops.append(((p.start, 1, 0), ("send", message, dst, p.feedback)))
        keys: List[Tuple[Tuple[int, int, int], TransferKey]] = []
        for j in self.mine:  # inputs of my segments for tick t + 1
            p = self.in_flight.get(t + 1 - j) if j > 0 else None
            if p is not None:
                src = self.prev_peer[j]
                ops.append(((p.start, 0, 0), ("recv", (p.hidden, p.hidden_dtype), src)))
                keys.append(((p.start, 0, 0), (p.start, j, 0)))
                if self.carries[j - 1] and p.extra:
                    for e, (shape, dtype) in enumerate(p.extra, start=1):
                        ops.append(((p.start, 0, e), ("recv", (shape, dtype), src)))
                        keys.append(((p.start, 0, e), (p.start, j, e)))
        p = self.in_flight.get(t - (self.K - 1))
        if p is not None and p.feedback is not None and self.reads_feedback:
            ops.append(((p.start, 1, 0), ("recv", (p.feedback, torch.long), self.last_peer)))
            keys.append(((p.start, 1, 0), (p.start, -1, 0)))
        order = sorted(range(len(ops)), key=lambda i: ops[i][0])  # stable: sends before receives of one key
        recv_order = sorted(range(len(keys)), key=lambda i: keys[i][0])
        return [ops[i][1] for i in order], [keys[i][1] for i in recv_order]


HOST_PHASES = ("pick", "stage", "exchange", "feedback")  # one tick's host work, in order (Timeline.decode_host)
TICK_KINDS = ("decode", "prefill", "mixed")  # Timeline.tick_kinds: what the passes in flight during a tick are
HOST_LATE_S = 50e-6  # a span the GPU starts within this of its issue found the GPU idle (the host was late)
HOLD_POLL_S = 20e-6  # `hold_back` polls its event this often: a spin of query() would take a core from the host


class Timeline:
    """Compute and wall time of one rank over the ticks of a `PipelineSchedule`, resolved once at the end (no host
    sync while running). A tick: `tick_start`, then `span_start` / `span_end` around each segment it computes, then
    `tick_end`; `count_host` adds a decode tick's host phases.

    `mark()` is a CUDA event recorded on the stream current at `begin()` (GPU) or perf_counter (CPU). Consecutive
    ticks share their boundary mark, so a tick costs three marks (its boundary, its span's start and end): on a
    host that builds a small model's decode pass in under a millisecond, a mark is a measurable part of the tick.
    Decode ticks are summed separately (`decode_busy`): ticks in which every pass in flight is a decode step, and
    was in the K-1 ticks before (K: `segments`, the pipeline's; the same ticks on every rank). A prefill pass that
    takes a rank longer than a decode pass holds up its group's next pass until its feedback returns, and the ranks
    downstream wait for that in the first ticks after it leaves the pipeline; those waits belong to the prefill.
    `busy_after_prefill` reports them: the busy fraction in the 1st, ..., (K-1)th tick after a prefill pass left.
    Each tick also has a kind (`TICK_KINDS`, from the passes in flight: decode, mixed with a mixed pass among them,
    else prefill): `resolve` counts them, gives the busy fraction of the mixed ticks and the run as segments of
    consecutive ticks of one kind (what bench_serve's figure draws)."""

    def __init__(self, device: torch.device, segments: int = 1):
        self.cuda = torch.device(device).type == "cuda"
        self.segments = segments
        self.calm = segments - 1  # consecutive ticks with only decode steps in flight (none before the run)
        self.after_prefill: List[int] = []  # per tick: min(calm, segments); 0: a prefill pass was in flight
        self.span_ticks: List[int] = []  # the tick of each span (parallel to `spans`)
        self.spans: List[Tuple[Any, Any, bool]] = []  # (start, end, decode tick) of each compute segment
        self.ticks: List[Tuple[Any, Any, bool]] = []  # (start, end, decode) of every tick
        self.tick_kinds: List[str] = []  # the kind of every tick (parallel to `ticks`, one of TICK_KINDS)
        self.start = self.end = None
        self.stream = None  # GPU: the stream every mark is recorded on (looked up once, not per mark)
        self.boundary = None  # the mark that ended the previous tick (or the start)
        # host side (perf_counter): when each span's start mark was issued (parallel to `spans`), and the host
        # seconds of each phase of the decode ticks (`HOST_PHASES`), to tell a GPU waiting on its host from one
        # waiting on its partner
        self.issued: List[float] = []
        self.host_start: Optional[float] = None
        self.decode_host = dict.fromkeys(HOST_PHASES, 0.0)
        self.decode_ticks = 0
        self.held_s = 0.0  # host seconds spent in `hold_back` waiting for its GPU
        self._resolved = False  # `resolve` turned the marks into seconds from the start
        if not self.cuda:
            self.mark = time.perf_counter  # a tick costs three marks: no wrapper around the clock

    def begin(self) -> None:
        """Mark the start of a run. On GPU it first waits for the device to go idle (setup, not a step), so the start
        event fires as it is issued and GPU times from it compare with host times from `host_start`."""
        if self.cuda:
            torch.cuda.synchronize()
            self.stream = torch.cuda.current_stream()
        self.start = self.boundary = self.mark()
        self.host_start = time.perf_counter()

    def mark(self):
        """A CUDA event recorded now on the timeline's stream (on CPU `mark` is time.perf_counter itself)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def hold_back(self, ticks_ahead: int) -> None:
        """GPU: return once the GPU has finished the tick `ticks_ahead` ticks before the one about to start, so the
        host never has more than ticks_ahead - 1 ticks queued on it. Polls the tick's end event (`query` does not
        synchronise the device or the stream) and adds the wait to `held_s`. CPU: nothing (every tick has run by
        the time the next one starts)."""
        if not self.cuda or len(self.ticks) < ticks_ahead:
            return
        done = self.ticks[-ticks_ahead][1]
        if done.query():
            return
        t0 = time.perf_counter()
        while not done.query():
            time.sleep(HOLD_POLL_S)
        self.held_s += time.perf_counter() - t0

    def tick_start(self, all_decode: bool) -> bool:
        """Start a tick in which every pass in flight is a decode step (or not) -> whether it is a decode tick."""
        self.calm = self.calm + 1 if all_decode else 0
        self.after_prefill.append(min(self.calm, self.segments))
        return self.calm >= self.segments

    def tick_end(self, decode: bool, kind: str = "prefill") -> None:
        """Close the current tick: from the previous boundary to now. decode: a decode tick (`tick_kind`); kind: one
        of TICK_KINDS (decode ticks' passes all decode, but the first K-1 after another kind are not decode ticks)."""
        end = self.mark()
        self.ticks.append((self.boundary, end, decode))
        self.tick_kinds.append(kind)
        self.boundary = end

    def span_start(self):
        """`mark()` for the start of a compute span, noting when the host issued it."""
        self.issued.append(time.perf_counter())
        self.span_ticks.append(len(self.ticks))
        return self.mark()

    def span_end(self, start, decode: bool):
        """Close a compute span opened by `span_start` -> its end mark."""
        end = self.mark()
        self.spans.append((start, end, decode))
        return end

    def count_host(self, h0: float, h1: float, h2: float, h3: float, h4: float) -> None:
        """A decode tick's host phases (`HOST_PHASES`) from the perf_counter readings that bound them."""
        self.decode_ticks += 1
        phases = self.decode_host
        phases["pick"] += h1 - h0
        phases["stage"] += h2 - h1
        phases["exchange"] += h3 - h2
        phases["feedback"] += h4 - h3

    def latencies(self, first: Dict[int, Any], last: Dict[int, Any], counts: Dict[int, int]):
        """Marks of each request's first and last token, and its token count -> ({request: seconds from the start
        to its first token}, {request: mean seconds per later token, None for one token}); call after `resolve`."""
        at = self.mark_seconds
        ttft = {r: at(m) for r, m in first.items()}
        tpot = {r: (at(last[r]) - at(m)) / (counts[r] - 1) if counts[r] > 1 else None for r, m in first.items()}
        return ttft, tpot

    def mark_seconds(self, mark) -> float:
        """A mark recorded during the run -> its seconds from the start; call after `resolve`."""
        return self._event_seconds[id(mark)] if self.cuda else mark - self._start_clock

    def _to_seconds(self) -> None:
        """Once, at `resolve`: every tick and span mark becomes its seconds from the start (GPU: one elapsed_time
        per event, after the synchronise), so what follows is arithmetic on floats on both devices."""
        if self._resolved:
            return
        self._resolved = True
        start = self._start_clock = self.start
        if self.cuda:
            events = [
                self.end,
                *(m for tick in self.ticks for m in tick[:2]),
                *(m for sp in self.spans for m in sp[:2]),
            ]
            self._event_seconds = {id(ev): start.elapsed_time(ev) / 1e3 for ev in events}
            self._event_seconds[id(start)] = 0.0
            sec = self._event_seconds
            self.ticks = [(sec[id(a)], sec[id(b)], d) for a, b, d in self.ticks]
            self.spans = [(sec[id(a)], sec[id(b)], d) for a, b, d in self.spans]
            self.start, self.end = 0.0, sec[id(self.end)]
        else:
            self.ticks = [(a - start, b - start, d) for a, b, d in self.ticks]
            self.spans = [(a - start, b - start, d) for a, b, d in self.spans]
            self.start, self.end = 0.0, self.end - start

    def resolve(self) -> Dict[str, Any]:
        """Synchronises once, then -> wall_s, busy_s, busy_fraction, decode_wall_s, decode_busy_s, decode_busy,
        busy_after_prefill and the host summary."""
        if self.cuda:
            torch.cuda.synchronize()
        if self.start is None or self.end is None:
            return {
                "wall_s": 0.0,
                "busy_s": 0.0,
                "busy_fraction": 0.0,
                "decode_wall_s": 0.0,
                "decode_busy_s": 0.0,
                "decode_busy": 0.0,
                "busy_after_prefill": [],
                **self._kind_summary(),
                **self._host_summary(),
            }
        self._to_seconds()
        wall = self.end - self.start
        busy = sum(b - a for a, b, _ in self.spans)
        dwall = sum(b - a for a, b, d in self.ticks if d)
        dbusy = sum(b - a for a, b, d in self.spans if d)
        return {
            "wall_s": wall,
            "busy_s": busy,
            "busy_fraction": busy / wall if wall > 0 else 0.0,
            "decode_wall_s": dwall,
            "decode_busy_s": dbusy,
            "decode_busy": dbusy / dwall if dwall > 0 else 0.0,
            "busy_after_prefill": self._after_prefill(),
            **self._kind_summary(),
            **self._host_summary(),
        }

    def _kind_summary(self) -> Dict[str, Any]:
        """tick_kinds: {kind: ticks}; mixed_wall_s and mixed_busy: wall time of the mixed ticks and the share of it
        this rank computed; tick_segments: [(start s, end s, kind)] of each run of consecutive ticks of one kind,
        from the run's start. Call from `resolve` (after `_to_seconds`)."""
        counts = {k: self.tick_kinds.count(k) for k in TICK_KINDS}
        if self.start is None or not self.ticks:
            return {"tick_kinds": counts, "mixed_wall_s": 0.0, "mixed_busy": 0.0, "tick_segments": []}
        mixed = [k == "mixed" for k in self.tick_kinds]
        mwall = sum(b - a for (a, b, _), m in zip(self.ticks, mixed) if m)
        mbusy = sum(b - a for (a, b, _), i in zip(self.spans, self.span_ticks) if i < len(mixed) and mixed[i])
        segments: List[List[Any]] = []
        for (a, b, _), kind in zip(self.ticks, self.tick_kinds):
            if segments and segments[-1][2] == kind:
                segments[-1][1] = b
            else:
                segments.append([a, b, kind])
        return {
            "tick_kinds": counts,
            "mixed_wall_s": mwall,
            "mixed_busy": mbusy / mwall if mwall > 0 else 0.0,
            "tick_segments": [tuple(s) for s in segments],
        }

    def _after_prefill(self) -> List[Optional[float]]:
        """[busy fraction of the ticks that came d ticks after a prefill pass left, for d = 1 .. K-1] (None: no such
        tick); call from `resolve` (after `_to_seconds`)."""
        wall, busy = [0.0] * (self.segments + 1), [0.0] * (self.segments + 1)
        for (a, b, _), d in zip(self.ticks, self.after_prefill):
            wall[d] += b - a
        for (a, b, _), i in zip(self.spans, self.span_ticks):
            if i < len(self.ticks):
                busy[self.after_prefill[i]] += b - a
        return [busy[d] / wall[d] if wall[d] > 0 else None for d in range(1, self.segments)]

    def _host_summary(self) -> Dict[str, Any]:
        """decode_host_ms_per_tick: {phase: host ms per decode tick}; host_held_s: host seconds held back from running
        further ahead of its GPU (`hold_back`); decode_lead_p50_ms: median of how long each
        decode span waited on the GPU after its host issued it, and decode_host_late: the share of decode spans that
        waited less than HOST_LATE_S (the GPU had run dry and waited on the host; GPU only, else None)."""
        ticks = max(self.decode_ticks, 1)
        out: Dict[str, Any] = {
            "decode_host_ms_per_tick": {k: v * 1e3 / ticks for k, v in self.decode_host.items()},
            "host_held_s": self.held_s,
            "decode_lead_p50_ms": None,
            "decode_host_late": None,
        }
        if not self.cuda or self.host_start is None:
            return out
        leads = sorted(a - (issued - self.host_start) for (a, _, d), issued in zip(self.spans, self.issued) if d)
        if leads:
            out["decode_lead_p50_ms"] = leads[len(leads) // 2] * 1e3
            out["decode_host_late"] = sum(x < HOST_LATE_S for x in leads) / len(leads)
        return out
