"""The pipeline schedule (dsaflow/pipeline/ticks.py) driven by a straight tick loop like the serving engine's, with
ranks as threads joined by an in-memory link (FIFO per pair, so a send and a receive that were posted in different
orders on the two sides would mismatch and fail)."""

import contextlib
import gc
import queue
import threading
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from dsaflow.pipeline.p2p import post_tick
from dsaflow.pipeline.ticks import PipelineSchedule, Timeline, segments_of
from dsaflow.pipeline.transfer_graphs import TransferGraphs


@dataclass
class Pass:
    """What the schedule moves: group (key), activation and feedback shapes, decode flag, a payload for the test."""

    group: int
    hidden: tuple
    hidden_dtype: torch.dtype
    payload: object = None
    feedback: Optional[tuple] = None
    decode_only: bool = False
    extra: tuple = ()
    token_major: bool = False
    start: int = -1
    finished_at: object = None


class TickLoop:
    """The engine's tick in a few lines over the schedule, a timeline and a link: pick, run my segments, finish on
    the last one, exchange, hand the leaving pass to on_feedback."""

    def __init__(self, owner, rank, link=None, device="cpu", feedback_ranks=None, transfer=None, ticks_ahead=None):
        self.schedule = PipelineSchedule(owner, rank, feedback_ranks=feedback_ranks)
        self.timeline = Timeline(torch.device(device), self.schedule.K)
        self.link, self.device, self.transfer, self.ticks_ahead = link, torch.device(device), transfer, ticks_ahead

    def run(self, pick, stage_fn, finish=None, on_feedback=None) -> int:
        sc, tl, t = self.schedule, self.timeline, 0
        tl.begin()
        while True:
            if self.ticks_ahead is not None:
                tl.hold_back(self.ticks_ahead)
            p = pick(lambda g: g not in sc.busy_groups)
            if p is None and not sc.in_flight:
                break
            work = sc.begin(t, p)
            decode = tl.tick_start(sc.decoding)
            outputs, message = [], None
            for j, q, x in work:
                span = tl.span_start()
                for s in sc.segments[j][1]:
                    x = stage_fn(q, s, x)
                if j == sc.K - 1 and finish is not None:
                    x = message = finish(q, x)
                end = tl.span_end(span, decode)
                if j == sc.K - 1:
                    q.finished_at = end
                outputs.append((j, q, x))
            ops, keys = sc.transfers(t, outputs, message)
            if ops:
                post = self.transfer if decode and self.transfer is not None else None
                received = post(ops) if post else post_tick(self.link, ops, self.device)
                message = sc.deliver(keys, received, message)
            tl.tick_end(decode, "decode" if decode else "prefill")
            done = sc.leave(t)
            if done is not None and on_feedback is not None and done.feedback is not None:
                on_feedback(done, message)
            if decode:
                tl.count_host(0.0, 1e-6, 2e-6, 3e-6, 4e-6)
            t += 1
        tl.end = tl.mark()
        return t


def run_passes(loop: TickLoop, passes, stage_fn) -> int:
    queue_ = list(passes)
    return loop.run(lambda free: queue_.pop(0) if queue_ else None, stage_fn)


class RecordingCapturer:
    """Like a CUDA graph capture: records the transfers without posting them; each replay posts them."""

    def __init__(self):
        self.captured = 0

    def __call__(self, fn):
        self.captured += 1
        return Replay(fn)


class Replay:
    def __init__(self, fn):
        self.replay, self.was_reset = fn, False

    def reset(self):
        self.was_reset = True


class QueueLink:
    def __init__(self, rank, queues):
        self.rank, self.queues = rank, queues

    def exchange(self, ops):
        for kind, tensor, peer in ops:
            if kind == "send":
                self.queues[(self.rank, peer)].put(tensor.clone())
        for kind, tensor, peer in ops:
            if kind == "recv":
                got = self.queues[(peer, self.rank)].get(timeout=20)
                assert got.shape == tensor.shape and got.dtype == tensor.dtype
                tensor.copy_(got)


def run_ranks(ranks, rank_main, timeout=60):
    """rank_main(rank) for every rank, each in its own thread (joined by a QueueLink); an exception in any of them
    fails the caller."""
    errors = []

    def guarded(rank):
        try:
            rank_main(rank)
        except Exception as exc:  # noqa: BLE001 - surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors


def serve_like(owner, groups, passes, feedback_ranks=None, leftovers=None, graphs=None, decode=True):
    """Every rank: `groups` keys, `passes` passes each; stage s adds 10**s; the last stage's feedback is the value,
    which the next pass of that key starts from (like a sampled token). -> per rank: (ticks, work log, feedback);
    a rank outside `feedback_ranks` logs (key, None). `leftovers` (a list) gets every message no one received.
    graphs (a dict): each rank's decode ticks' transfers through `TransferGraphs` with a recording capturer, stored
    there by rank; decode: the passes are decode steps."""
    ranks = sorted(set(owner.values()))
    queues = {(a, b): queue.Queue() for a in ranks for b in ranks if a != b}
    results = {}

    def rank_main(rank):
        link = QueueLink(rank, queues) if len(ranks) > 1 else None
        transfer = None
        if graphs is not None:
            transfer = graphs[rank] = TransferGraphs(link, "cpu", capturer=RecordingCapturer())
        ex = TickLoop(owner, rank, link, feedback_ranks=feedback_ranks, transfer=transfer)
        done = {g: 0 for g in range(groups)}
        value = {g: float(g) for g in range(groups)}
        log, fed = [], []
        state = {"rr": 0, "tick": 0}

        def pick(free):
            state["tick"] += 1
            for k in range(groups):
                g = (state["rr"] + k) % groups
                if free(g) and done[g] < passes:
                    state["rr"] = g + 1
                    return Pass(g, (1, 1, 2), torch.float32, payload=value[g], feedback=(2, 1), decode_only=decode)
            return None

        def stage_fn(pass_, s, x):
            log.append((state["tick"], s, pass_.group))
            base = torch.full((1, 1, 2), pass_.payload) if s == 0 else x
            return base + 10**s

        def finish(pass_, out):
            return torch.tensor([[int(out[0, 0, 0])], [0]])

        def on_feedback(pass_, msg):
            done[pass_.group] += 1
            if msg is None:
                fed.append((pass_.group, None))
                return
            value[pass_.group] = float(msg[0, 0])
            fed.append((pass_.group, int(msg[0, 0])))

        ticks = ex.run(pick, stage_fn, finish, on_feedback)
        results[rank] = (ticks, log, fed)

    run_ranks(ranks, rank_main)
    if leftovers is not None:
        leftovers.extend(q.get() for q in queues.values() for _ in range(q.qsize()))
    return results


def test_segments_are_runs_of_one_rank():
    assert segments_of({0: 0, 1: 0, 2: 1, 3: 1}) == [(0, [0, 1]), (1, [2, 3])]
    assert segments_of({0: 0, 1: 1, 2: 0, 3: 1}) == [(0, [0]), (1, [1]), (0, [2]), (1, [3])]


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_two_ranks_groups_in_flight(groups):
    res = serve_like({0: 0, 1: 1}, groups, passes=5)
    (t0, log0, fed0), (t1, _log1, fed1) = res[0], res[1]
    assert t0 == t1 and fed0 == fed1  # every rank walked the same ticks and saw the same feedback
    # each pass adds 1 + 10 on top of the previous one's value: the feedback chain is intact
    for g in range(groups):
        assert [v for k, v in fed0 if k == g] == [g + 11 * (i + 1) for i in range(5)]
    busy0 = len({t for t, _, _ in log0})
    if groups == 1:  # one group: each rank works every other tick
        assert t0 == 2 * 5 and busy0 == 5
    else:  # two or more: rank 0 works every tick but the drain
        assert t0 == 5 * groups + 1 and busy0 == 5 * groups


@pytest.mark.parametrize("owner", [{0: 0, 1: 1}, {0: 0, 1: 1, 2: 2}, {0: 0, 1: 1, 2: 0, 3: 1}])
def test_transfers_replayed_from_graphs_equal_eager_posting(owner):
    """Every tick's transfers through TransferGraphs (captured once per signature, replayed after): the same ticks,
    work and feedback as posting them eagerly, from a handful of captures."""
    groups = len(owner)
    graphs = {}
    replayed = serve_like(owner, groups, passes=6, graphs=graphs)
    eager = serve_like(owner, groups, passes=6)
    assert replayed == eager
    prefill = {}
    assert serve_like(owner, groups, passes=6, graphs=prefill, decode=False) == eager
    assert all(tg.captures == tg.replays == 0 for tg in prefill.values())  # only decode ticks replay
    for tg in graphs.values():
        assert 0 < tg.captures <= 8 and tg.replays > 3 * tg.captures and tg.eager_ticks == 0  # fill, steady, drain


def test_transfer_graphs_pad_short_sends_and_reuse_static_buffers():
    """A send with fewer rows than its declared shape travels in the first rows of the static buffer; each signature
    is captured once; the receive buffer of a signature is the same tensor at every replay (read it before the next);
    past max_graphs, new signatures post eagerly (padded with zeros)."""
    queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    got = {0: [], 1: []}

    def rank_main(rank):
        tg = TransferGraphs(QueueLink(rank, queues), "cpu", capturer=RecordingCapturer(), max_graphs=2)
        for tick in range(6):
            rows = 1 + tick % 2  # two signatures (declared shapes), alternating, then a third past max_graphs
            declared = ((4, 3), (2, 3))[tick % 2] if tick < 5 else (5, 3)
            if rank == 0:
                out = tg([("send", torch.full((rows, 3), float(tick)), 1, declared)])
                assert out == []
            else:
                (buf,) = tg([("recv", (declared, torch.float32), 0)])
                got[1].append((tick, buf, buf.clone()))
        got[rank].append((tg.captures, tg.replays, tg.eager_ticks))

    run_ranks((0, 1), rank_main, timeout=30)
    assert got[0] == [(2, 5, 1)] and got[1][-1] == (2, 5, 1)
    for tick, _buf, seen in got[1][:-1]:
        rows = 1 + tick % 2
        assert torch.equal(seen[:rows], torch.full((rows, 3), float(tick)))
    assert got[1][0][1] is got[1][2][1] and got[1][1][1] is got[1][3][1]  # one static buffer per signature
    assert torch.equal(got[1][5][2][2:], torch.zeros(3, 3))  # eager: padded with zeros


def test_transfer_graphs_capture_with_the_garbage_collector_paused():
    """A collection during a capture may free a dead CUDA graph, which fails the capture (dsaflow/pipeline/capture_guard.py):
    the collector is off while a signature is captured, and back on for its replays."""
    seen = []

    class GcStateCapturer(RecordingCapturer):
        def __call__(self, fn):
            seen.append(gc.isenabled())
            return super().__call__(fn)

    class DropLink:
        def exchange(self, ops):
            seen.append(("posted", gc.isenabled()))

    tg = TransferGraphs(DropLink(), "cpu", capturer=GcStateCapturer())
    for _ in range(2):
        tg([("send", torch.ones(2, 3), 1, (2, 3))])
    assert seen == [False, ("posted", True), ("posted", True)] and gc.isenabled()
    assert (tg.captures, tg.replays) == (1, 2)


def test_feedback_goes_only_to_the_ranks_that_read_it():
    owner = {0: 0, 1: 1, 2: 2}
    unread = []
    res = serve_like(owner, 3, passes=4, feedback_ranks=[0], leftovers=unread)
    everyone = serve_like(owner, 3, passes=4)
    assert not unread  # no message was sent to a rank that did not post its receive
    assert res[0][2] == res[2][2] == everyone[0][2]  # stage 0's rank (and the sender) keep the whole chain
    assert res[1][2] == [(k, None) for k, _ in everyone[1][2]]  # the middle rank advances, without a message
    assert [r[0] for r in res.values()] == [r[0] for r in everyone.values()]  # the same ticks
    with pytest.raises(ValueError, match="feedback_ranks"):
        PipelineSchedule(owner, 0, feedback_ranks=[5])


def test_interleaved_stages_and_one_rank_agree():
    owner = {0: 0, 1: 1, 2: 0, 3: 1}
    res = serve_like(owner, 4, passes=3)
    local = serve_like({0: 0, 1: 0, 2: 0, 3: 0}, 4, passes=3)
    assert res[0][2] == res[1][2] and sorted(res[0][2]) == sorted(local[0][2])
    assert local[0][0] == 4 * 3  # one segment: one pass per tick, no bubble
    assert res[0][0] == 4 * 3 + 3  # four segments, four groups: full from the start, 3 ticks of drain


def test_passes_without_feedback_keep_microbatch_order():
    seen = []
    ex = TickLoop({0: 0, 1: 0}, 0)
    passes = [Pass(m, (1, 1, 1), torch.float32) for m in range(4)]
    ticks = run_passes(ex, passes, lambda pass_, s, x: seen.append((s, pass_.group)) or torch.zeros(1))
    assert ticks == 4 and seen == [(s, m) for m in range(4) for s in (0, 1)]


def test_timeline_ticks_tile_the_run_and_host_phases_are_counted():
    """Ticks share their boundaries (no gap between one tick's end and the next one's start), the last stage's span
    end is the pass's `finished_at`, and the host time of decode ticks is split by phase."""
    ex = TickLoop({0: 0, 1: 0}, 0)
    passes = [Pass(m, (1, 1, 1), torch.float32, feedback=(2, 1), decode_only=True) for m in range(3)]
    queue_ = list(passes)
    ex.run(
        lambda free: queue_.pop(0) if queue_ else None,
        lambda pass_, s, x: torch.zeros(1),
        finish=lambda pass_, out: torch.zeros(2, 1, dtype=torch.long),
    )
    tl = ex.timeline
    assert len(tl.ticks) == 3 and tl.ticks[0][0] == tl.start
    assert all(a[1] == b[0] for a, b in zip(tl.ticks, tl.ticks[1:]))  # contiguous: the tick walls tile the run
    assert [i.finished_at for i in passes] == [end for _, end, _ in tl.spans]
    assert tl.decode_ticks == 3 and len(tl.issued) == len(tl.spans) == 3
    summary = tl.resolve()
    assert summary["decode_wall_s"] == pytest.approx(tl.ticks[-1][1] - tl.start)
    host = summary["decode_host_ms_per_tick"]
    assert set(host) == {"pick", "stage", "exchange", "feedback"} and all(v >= 0 for v in host.values())
    assert sum(host.values()) > 0
    assert summary["decode_lead_p50_ms"] is None and summary["decode_host_late"] is None  # GPU only


def test_decode_ticks_begin_k_minus_1_ticks_after_a_prefill_leaves():
    """A tick is a decode tick of the timeline once the passes in flight in it and in the K-1 ticks before it were
    all decode steps: a long prefill pass keeps the ranks downstream of it waiting for up to K-1 ticks after it
    leaves, and that wait is the prefill's. The same ticks on every rank; each span carries its tick's flag."""
    owner = {0: 0, 1: 1, 2: 2}  # K = 3
    decode = [True] * 4 + [False] + [True] * 8  # pass 4 (a prefill) is in flight at ticks 4, 5, 6
    queues = {(a, b): queue.Queue() for a in range(3) for b in range(3) if a != b}
    seen = {}

    def rank_main(rank):
        ex = TickLoop(owner, rank, QueueLink(rank, queues))
        todo = list(range(len(decode)))

        def pick(free):
            return Pass(todo[0], (1, 1, 1), torch.float32, decode_only=decode[todo.pop(0)]) if todo else None

        ticks = ex.run(pick, lambda pass_, s, x: torch.zeros(1, 1, 1) if x is None else x + 1)
        tl = ex.timeline
        after = tl.resolve()["busy_after_prefill"]
        # ticks 7 and 8 come 1 and 2 ticks after the prefill left; rank r runs its span of pass i in tick i + r
        spans_in = {t: tl.spans[t - rank] for t in (7, 8)}
        span, tick = (
            {t: spans_in[t][1] - spans_in[t][0] for t in (7, 8)},
            {t: tl.ticks[t][1] - tl.ticks[t][0] for t in (7, 8)},
        )
        want = [span[t] / tick[t] for t in (7, 8)]  # seconds after resolve
        assert after == pytest.approx(want)
        seen[rank] = (ticks, [d for _, _, d in tl.ticks], [d for _, _, d in tl.spans], tl.decode_ticks, after)

    run_ranks(range(3), rank_main)
    expected = [True] * 4 + [False] * 5 + [True] * 6  # ticks 7 and 8 hold decode steps only, but follow the prefill
    for rank, (ticks, flags, spans, decode_ticks, after) in seen.items():
        assert ticks == len(decode) + 2 and flags == expected and decode_ticks == sum(expected)
        assert spans == expected[rank : rank + len(decode)]  # rank r runs pass i at tick i + r
        assert len(after) == 2 and all(0 < f <= 1 for f in after)


def test_leave_together_meets_peers_only_on_success(monkeypatch):
    """A rank that finished meets its peers at a barrier before destroying the group (a gloo peer still reading
    its last message aborts otherwise); after an error it destroys the group without waiting for peers that may
    never come."""
    import dsaflow.pipeline.p2p as p2p

    calls = []
    monkeypatch.setattr(p2p.dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    monkeypatch.setattr(p2p.dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    with p2p.leave_together("g"):
        calls.append(("body",))
    assert calls == [("body",), ("barrier", "g"), ("destroy",)]
    calls.clear()
    with pytest.raises(ValueError):
        with p2p.leave_together():
            raise ValueError("rank failed")
    assert calls == [("destroy",)]


@pytest.mark.parametrize("fails", [False, True])
def test_transfer_graphs_are_released_before_the_group_is_destroyed(monkeypatch, fails):
    """A live CUDA graph that captured NCCL transfers makes destroying the process group hang, so `leave_together`
    releases every TransferGraphs after the barrier and before the destroy, on success and after an error; a
    released one refuses further ticks, and one already collected is skipped."""
    import dsaflow.pipeline.p2p as p2p

    calls = []
    monkeypatch.setattr(p2p.dist, "barrier", lambda group=None: calls.append("barrier"))
    monkeypatch.setattr(p2p.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(p2p, "_graph_holders", [])
    capturer = RecordingCapturer()
    ops = [("send", torch.ones(2, 3), 1, (2, 3)), ("recv", ((2, 3), torch.float32), 1)]
    link = types.SimpleNamespace(exchange=lambda posted: calls.append("exchange"))
    kept = TransferGraphs(link, "cpu", capturer=capturer)
    TransferGraphs(link, "cpu", capturer=RecordingCapturer())  # dropped at once: its weak entry is skipped
    kept(ops)
    graphs = [g for g, _ in kept.graphs.values()]
    with pytest.raises(ValueError) if fails else contextlib.nullcontext():
        with p2p.leave_together():
            calls.append("body")
            if fails:
                raise ValueError("rank failed")
    assert not kept.graphs and all(g.was_reset for g in graphs)
    released_at = calls.index("destroy")
    assert calls[:released_at] == ["exchange", "body"] + ([] if fails else ["barrier"])
    with pytest.raises(RuntimeError, match="after release"):
        kept(ops)


def test_stage_link_posts_a_tick_in_one_coalescing_block(monkeypatch):
    """With a coalescing backend (NCCL) a tick's ops go to the process group inside one coalescing block, in the
    order given, then one wait; without a process group the link falls back to batch_isend_irecv."""
    import dsaflow.pipeline.p2p as p2p

    calls = []

    class FakeWork:
        def wait(self):
            calls.append("wait")

    class FakeGroup:
        def _start_coalescing(self, device):
            calls.append(("start", str(device)))

        def send(self, tensors, peer, tag):
            calls.append(("send", peer, tuple(tensors[0].shape)))

        def recv(self, tensors, peer, tag):
            calls.append(("recv", peer))
            tensors[0].fill_(7)

        def _end_coalescing(self, device):
            calls.append("end")
            return FakeWork()

    monkeypatch.setattr(p2p.dist.distributed_c10d, "_get_default_group", lambda: FakeGroup())
    link = p2p.StageLink("cpu", coalesce=True)
    got = torch.zeros(2)
    link.exchange([("send", torch.ones(3), 1), ("recv", got, 2)])
    assert calls == [("start", "cpu"), ("send", 1, (3,)), ("recv", 2), "end", "wait"]
    assert got.tolist() == [7, 7]
    assert p2p.StageLink("cpu")._group is None  # no process group: nothing coalesces


def _ticks_queued_at_each_pick(max_ticks_ahead, passes: int = 24):
    """Run `passes` one-stage passes whose GPU work (a ~1 ms spin) far outlasts the host's; at every pick, count the
    earlier ticks the GPU has not finished yet (their end events not yet done)."""
    ex = TickLoop({0: 0}, 0, device="cuda", ticks_ahead=max_ticks_ahead)
    todo = [Pass(m, (1, 1, 1), torch.float32) for m in range(passes)]
    queued = []

    def pick(free):
        queued.append(sum(not end.query() for _, end, _ in ex.timeline.ticks))
        return todo.pop(0) if todo else None

    def stage(pass_, s, x):
        torch.cuda._sleep(2_000_000)  # GPU clock cycles: about a millisecond on an H100 / H200
        return torch.zeros(1, device="cuda")

    with torch.cuda.device(0):
        ex.run(pick, stage)
    torch.cuda.synchronize()
    return queued, ex.timeline


@pytest.mark.gpu
def test_host_stays_max_ticks_ahead_of_its_gpu():
    """With max_ticks_ahead=L the host picks tick t only after the GPU finished tick t - L, so at most L - 1 ticks
    are queued at any pick; unbounded, the host (microseconds per tick) runs far ahead of the GPU (a millisecond)."""
    bounded, tl = _ticks_queued_at_each_pick(2)
    assert max(bounded) <= 1 and tl.held_s > 0
    assert tl.resolve()["host_held_s"] == tl.held_s
    unbounded, tl = _ticks_queued_at_each_pick(None)
    assert max(unbounded) >= 8 and tl.held_s == 0
