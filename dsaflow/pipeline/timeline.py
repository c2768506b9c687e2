"""Per-rank compute and wall time of a pipelined run (`PipelineExecutor`), with no host sync while it runs.

Busy fractions (whole run and decode ticks), where the host's time goes per decode tick, whether the GPU waited on
its host, and per-request time to first token and per output token.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

HOST_PHASES = ("pick", "stage", "exchange", "feedback")  # one tick's host work, in order (Timeline.decode_host)
TICK_KINDS = ("decode", "prefill", "mixed")  # Timeline.tick_kinds: what the passes in flight during a tick are
HOST_LATE_S = 50e-6  # a span the GPU starts within this of its issue found the GPU idle (the host was late)
HOLD_POLL_S = 20e-6  # `hold_back` polls its event this often: a spin of query() would take a core from the host


class Timeline:
    """Compute and wall time of one rank, resolved once at the end (no host sync while running).

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

    def begin(self) -> None:
        """Mark the start of a run. On GPU it first waits for the device to go idle (setup, not a step), so the start
        event fires as it is issued and GPU times from it compare with host times from `host_start`."""
        if self.cuda:
            torch.cuda.synchronize()
            self.stream = torch.cuda.current_stream()
        self.start = self.boundary = self.mark()
        self.host_start = time.perf_counter()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
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

    def tick_kind(self, all_decode: bool) -> bool:
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

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def latencies(self, first: Dict[int, Any], last: Dict[int, Any], counts: Dict[int, int]):
        """Marks of each request's first and last token, and its token count -> ({request: seconds from the start
        to its first token}, {request: mean seconds per later token, None for one token}); call after `resolve`."""
        ttft = {r: self.seconds(self.start, m) for r, m in first.items()}
        tpot = {r: self.seconds(m, last[r]) / (counts[r] - 1) if counts[r] > 1 else None for r, m in first.items()}
        return ttft, tpot

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
        wall = self.seconds(self.start, self.end)
        busy = sum(self.seconds(a, b) for a, b, _ in self.spans)
        dwall = sum(self.seconds(a, b) for a, b, d in self.ticks if d)
        dbusy = sum(self.seconds(a, b) for a, b, d in self.spans if d)
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
        from the run's start. Call from `resolve` (it reads the marks)."""
        counts = {k: self.tick_kinds.count(k) for k in TICK_KINDS}
        if self.start is None or not self.ticks:
            return {"tick_kinds": counts, "mixed_wall_s": 0.0, "mixed_busy": 0.0, "tick_segments": []}
        mixed = [k == "mixed" for k in self.tick_kinds]
        mwall = sum(self.seconds(a, b) for (a, b, _), m in zip(self.ticks, mixed) if m)
        mbusy = sum(
            self.seconds(a, b) for (a, b, _), i in zip(self.spans, self.span_ticks) if i < len(mixed) and mixed[i]
        )
        segments: List[List[Any]] = []
        for (a, b, _), kind in zip(self.ticks, self.tick_kinds):
            if segments and segments[-1][2] == kind:
                segments[-1][1] = self.seconds(self.start, b)
            else:
                segments.append([self.seconds(self.start, a), self.seconds(self.start, b), kind])
        return {
            "tick_kinds": counts,
            "mixed_wall_s": mwall,
            "mixed_busy": mbusy / mwall if mwall > 0 else 0.0,
            "tick_segments": [tuple(s) for s in segments],
        }

    def _after_prefill(self) -> List[Optional[float]]:
        """[busy fraction of the ticks that came d ticks after a prefill pass left, for d = 1 .. K-1] (None: no such
        tick); call from `resolve`."""
        wall, busy = [0.0] * (self.segments + 1), [0.0] * (self.segments + 1)
        for (a, b, _), d in zip(self.ticks, self.after_prefill):
            wall[d] += self.seconds(a, b)
        for (a, b, _), i in zip(self.spans, self.span_ticks):
            if i < len(self.ticks):
                busy[self.after_prefill[i]] += self.seconds(a, b)
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
        leads = sorted(
            self.seconds(self.start, a) - (issued - self.host_start)
            for (a, _, d), issued in zip(self.spans, self.issued)
            if d
        )
        if leads:
            out["decode_lead_p50_ms"] = leads[len(leads) // 2] * 1e3
            out["decode_host_late"] = sum(x < HOST_LATE_S for x in leads) / len(leads)
        return out
