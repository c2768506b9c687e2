"""The pipelined forward executor: passes (a microbatch's forward, a serving group's pass) move through the stages
in ticks.

Used by serving (dsaflow.serve.engine), evaluation and the dense warm-up (dsaflow.train.forward_pass); the training
schedules (forward + backward) are torch.distributed.pipelining's, not this.

The stages are cut into *segments*: maximal runs of consecutive stages owned by one rank (a rank running every stage
has one segment; pp2 has two; an interleaved pp2 with four stages has four). Every rank walks the same ticks:

    tick t:  segment j runs the pass that started at tick t - j (one pass per segment per tick)
             then one batch of point-to-point ops: each segment's output to the next segment's rank, and the last
             segment's feedback (serving: the sampled tokens + EOS flags) to the ranks that read it (by default
             every other rank; serving without EOS: only stage 0's, which feeds the tokens back in), all posted together
             with the receives of the next tick (`StageLink.exchange`), so sends around a ring never deadlock

Passes carry a `key` (a serving group). A pass whose key is still in flight cannot start: with feedback, pass i's
first stage needs the tokens its key's previous pass sampled on the last stage. So with G keys (groups) and K
segments, G >= K keeps every segment busy every tick in steady state, and G = 1 leaves each rank idle (K-1)/K of the
time (the schedule of one batch at a time). Without feedback (evaluation) passes start one per tick.

The schedule is a pure function of what `pick` returns, and `pick` runs on every rank with the same information
(host-known facts plus the feedback every rank receives), so every rank posts matching ops without talking.
A `Timeline` (timeline.py) records, per rank, the time its segments computed (CUDA events on GPU, perf_counter on
CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .timeline import HOST_PHASES, Timeline
from .transfer_graphs import post_eagerly


@dataclass
class Pass:
    """One forward through every stage: a microbatch (evaluation, the dense warm-up) or a serving group's pass.

    key: passes with the same key run one after the other (the next starts once the previous pass's feedback
        arrived).
    hidden: shape of the activation a stage sends to the next ([rows, tokens, dim]); hidden_dtype its dtype.
    feedback: shape of the int64 message the last stage sends to the feedback ranks ([rows, 2] for serving), or None.
    payload: whatever the caller's stage function needs (never read by the executor); serving: the scheduler's
        Pass (dsaflow.serve.scheduler).
    decode: the pass is a decode step (the timeline reports the busy fraction of decode ticks separately).
    mixed: the pass is a serving mixed pass (decode rows and prompt chunks in one token-major pass): a tick with one
        in flight is a mixed tick of the timeline (`Timeline.tick_kinds`).
    extra: (shape, dtype) of each tensor that travels with the activation across the boundaries `carries_extra`
        names (cross-stage top-k indices, int32 [rows, tokens, k]); there a stage returns (hidden, *extra) and the
        next stage receives that tuple. Elsewhere a tuple output sends only its hidden state.
    """

    key: int
    hidden: Tuple[int, ...]
    hidden_dtype: torch.dtype
    payload: Any = None
    feedback: Optional[Tuple[int, ...]] = None
    decode: bool = False
    extra: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...] = ()
    mixed: bool = False
    start: int = -1  # set by the executor: the tick at which segment 0 ran the pass
    finished_at: Any = None  # set on the last stage's rank: the Timeline mark that ends the pass's last span


def tick_kind(all_decode: bool, in_flight) -> str:
    """The kind of a tick from the passes in flight (the same on every rank): decode when every one decodes, mixed
    when one is a mixed pass, else prefill."""
    return "decode" if all_decode else "mixed" if any(f.mixed for f in in_flight) else "prefill"


def segments_of(owner: Dict[int, int]) -> List[Tuple[int, List[int]]]:
    """{stage: rank} -> [(rank, [stages])] runs of consecutive stages on one rank, in stage order."""
    segs: List[Tuple[int, List[int]]] = []
    for s in sorted(owner):
        if segs and segs[-1][0] == owner[s]:
            segs[-1][1].append(s)
        else:
            segs.append((owner[s], [s]))
    return segs


class PipelineExecutor:
    """owner: {stage: pipeline rank}; rank: this process's pipeline rank; link: a StageLink (None when every stage is
    local); peer: pipeline rank -> global rank for the link (identity by default); carries_extra(stage): whether
    the boundary after `stage` carries each pass's `extra` tensors (default: none does); feedback_ranks: the
    pipeline ranks that receive each pass's feedback (default: every rank). A transfer costs every rank on its path
    host time each tick, so a message nobody reads is not sent. decode_transfer(ops) -> received tensors: how the
    transfers of a decode tick (every pass in flight decodes; the same ticks on every rank) are posted, e.g. replayed
    from CUDA graphs (`TransferGraphs`); other ticks, and all by default, post eagerly on the link (`post_eagerly`).
    A send travels at its pass's declared shape (`hidden`, `extra`, `feedback`): an output with fewer rows is padded.
    max_ticks_ahead: on a GPU, a tick starts only once the GPU has finished the tick this many before it
    (`Timeline.hold_back`); None: the host runs as far ahead as its launches queue. What a pass carries is decided
    when it is picked, so the further the host runs ahead, the later a request that arrives joins one."""

    def __init__(
        self,
        owner: Dict[int, int],
        rank: int,
        link=None,
        device="cpu",
        peer: Optional[Callable[[int], int]] = None,
        carries_extra: Optional[Callable[[int], bool]] = None,
        feedback_ranks: Optional[Sequence[int]] = None,
        decode_transfer: Optional[Callable[[list], List[torch.Tensor]]] = None,
        max_ticks_ahead: Optional[int] = None,
    ):
        if max_ticks_ahead is not None and max_ticks_ahead < 1:
            raise ValueError(f"PipelineExecutor: max_ticks_ahead={max_ticks_ahead} must be 1 or more (or None).")
        self.max_ticks_ahead = max_ticks_ahead
        self.segments = segments_of(owner)
        self.carries_extra = carries_extra or (lambda stage: False)
        self.rank, self.link, self.device = rank, link, torch.device(device)
        self.peer = peer or (lambda r: r)
        self.mine = [j for j, (r, _) in enumerate(self.segments) if r == rank]
        if len(self.segments) > 1 and link is None:
            raise ValueError("PipelineExecutor: stages live on several ranks but no link was given.")
        self.ranks = sorted({r for r, _ in self.segments})
        self.feedback_ranks = sorted(set(self.ranks if feedback_ranks is None else feedback_ranks) | {self.last_rank})
        unknown = set(self.feedback_ranks) - set(self.ranks)
        if unknown:
            raise ValueError(f"PipelineExecutor: feedback_ranks {sorted(unknown)} run no stage.")
        self.timeline = Timeline(self.device, len(self.segments))
        self.decode_transfer = decode_transfer

    @property
    def last_rank(self) -> int:
        return self.segments[-1][0]

    def run(
        self,
        pick: Callable[[Callable[[int], bool]], Optional[Pass]],
        stage_fn: Callable[[Pass, int, Optional[torch.Tensor]], torch.Tensor],
        finish: Optional[Callable[[Pass, torch.Tensor], Optional[torch.Tensor]]] = None,
        on_feedback: Optional[Callable[[Pass, torch.Tensor], None]] = None,
    ) -> int:
        """Run passes until `pick` has none left and nothing is in flight; returns the number of ticks.

        pick(free) -> the pass to start this tick, or None (a bubble; the end once nothing is in flight). Called on
            every rank, once per tick; free(key) says whether a key has no pass in flight.
        stage_fn(pass_, stage, x) -> the stage's output; x is None on stage 0 (the caller feeds its own input).
        finish(pass_, out) on the last stage's rank -> the feedback message (int64, pass_.feedback shape) or None.
        on_feedback(pass_, message) on every rank, when the pass's feedback has arrived (the same tick on all ranks);
            message is None on a rank outside `feedback_ranks`.
        """
        K, tl = len(self.segments), self.timeline
        started: Dict[int, Pass] = {}  # start tick -> pass in flight
        busy_keys: set = set()
        inbox: Dict[Tuple[int, int], torch.Tensor] = {}  # (start tick, segment) -> received input
        t = 0
        tl.begin()
        clock = time.perf_counter
        while True:
            if self.max_ticks_ahead is not None:
                tl.hold_back(self.max_ticks_ahead)  # before pick: what it schedules sees the latest arrivals
            h0 = clock()
            new = pick(lambda k: k not in busy_keys)
            if new is None and not started:
                break
            if new is not None:
                new.start = t
                started[t] = new
                busy_keys.add(new.key)
            mine_now = [(j, started[t - j]) for j in self.mine if (t - j) in started]
            h1 = clock()
            tick_decode = all(f.decode for f in started.values())  # the same on every rank
            steady = tl.tick_kind(tick_decode)  # a decode tick of the timeline (see Timeline)
            sends: List[Tuple[Tuple[int, int, int], torch.Tensor, int, Tuple[int, ...]]] = []
            message: Optional[torch.Tensor] = None
            for j, p in mine_now:
                x = inbox.pop((p.start, j)) if j > 0 else None
                a = tl.span_start()
                for s in self.segments[j][1]:
                    x = stage_fn(p, s, x)
                if j == K - 1 and finish is not None:
                    message = finish(p, x)
                tl.spans.append((a, tl.mark(), steady))
                if j == K - 1:
                    p.finished_at = tl.spans[-1][1]
                if j < K - 1:
                    parts = x if isinstance(x, tuple) else (x,)
                    dst = self.segments[j + 1][0]
                    sends.append(((p.start, 0, 0), parts[0].to(p.hidden_dtype), dst, p.hidden))
                    if self._carries(j, p):
                        for e, (part, (shape, _)) in enumerate(zip(parts[1:], p.extra), start=1):
                            sends.append(((p.start, 0, e), part, dst, shape))
                elif message is not None and p.feedback is not None:
                    for r in self.feedback_ranks:
                        if r != self.rank:
                            sends.append(((p.start, 1, 0), message, r, p.feedback))
            h2 = clock()
            recvs = self._recvs(t, started, K)
            got = self._exchange(sends, recvs, tick_decode)
            for (tick, j, part), buf in sorted(got.items(), key=lambda kv: kv[0]):
                if j == -1:
                    message = buf
                elif part == 0:
                    inbox[(tick, j)] = buf
                else:  # extra tensors follow their activation (sorted by part)
                    inbox[(tick, j)] = (
                        *(inbox[(tick, j)] if isinstance(inbox[(tick, j)], tuple) else (inbox[(tick, j)],)),
                        buf,
                    )
            tl.tick_end(steady, tick_kind(tick_decode, started.values()))
            h3 = clock()
            done = started.pop(t - (K - 1), None)
            if done is not None:
                busy_keys.discard(done.key)
                if on_feedback is not None and done.feedback is not None:
                    on_feedback(done, message)
            if steady:
                tl.decode_ticks += 1
                for phase, seconds in zip(HOST_PHASES, (h1 - h0, h2 - h1, h3 - h2, clock() - h3)):
                    tl.decode_host[phase] += seconds
            t += 1
        tl.end = tl.mark()
        return t

    def _carries(self, j: int, pass_: Pass) -> bool:
        """Whether the boundary after segment j carries the pass's extra tensors."""
        return bool(pass_.extra) and self.carries_extra(self.segments[j][1][-1])

    def _recvs(self, t: int, started: Dict[int, Pass], K: int) -> list:
        """Receives of this tick: inputs of my segments for tick t + 1 (the activation, then any extra tensors), and
        the feedback of a pass finishing now. Keys: (start tick, receiving segment or -1 for feedback, part)."""
        recvs = []
        for j in self.mine:
            if j > 0 and (t + 1 - j) in started:
                f = started[t + 1 - j]
                src = self.segments[j - 1][0]
                recvs.append(((f.start, j, 0), f.hidden, f.hidden_dtype, src))
                if self._carries(j - 1, f):
                    for e, (shape, dtype) in enumerate(f.extra, start=1):
                        recvs.append(((f.start, j, e), shape, dtype, src))
        f = started.get(t - (K - 1))
        if (
            f is not None
            and f.feedback is not None
            and self.last_rank != self.rank
            and self.rank in self.feedback_ranks
        ):
            recvs.append(((f.start, -1, 0), f.feedback, torch.long, self.last_rank))
        return recvs

    def _exchange(self, sends, recvs, decode: bool) -> Dict[Tuple[int, int], torch.Tensor]:
        """Post every send and receive of one tick in one batch, in a canonical order (start tick, then activations
        before feedback), which both sides of each pair build identically; return the received tensors."""
        if not sends and not recvs:
            return {}
        ops = [(key, "send", (tensor, shape), peer) for key, tensor, peer, shape in sends]
        ops += [(key, "recv", (shape, dtype), peer) for key, shape, dtype, peer in recvs]

        def order(op):  # sends key feedback as (start, 1, 0), receives as (start, -1, 0); activations come first,
            (start, j, part), kind = op[0], op[1]  # each followed by its extra tensors in part order
            return start, (j == 1) if kind == "send" else (j == -1), part

        ops.sort(key=order)
        posted = [
            ("send", what[0], self.peer(peer), what[1]) if kind == "send" else ("recv", what, self.peer(peer))
            for _, kind, what, peer in ops
        ]
        if decode and self.decode_transfer is not None:
            received = iter(self.decode_transfer(posted))
        else:
            received = iter(post_eagerly(self.link, posted, self.device))
        return {key: next(received) for key, kind, _, _ in ops if kind == "recv"}


def run_passes(executor: PipelineExecutor, passes: Sequence[Pass], stage_fn, finish=None) -> int:
    """Every pass once, in order, one per tick (no feedback: evaluation, the dense warm-up)."""
    queue = list(passes)

    def pick(free):
        return queue.pop(0) if queue else None

    return executor.run(pick, stage_fn, finish)
