"""The workers of `dsaflow serve`: the pipelined engine fed by live requests. `run_online(ctx)` is the worker's
"serve" job; the HTTP front end runs in the parent (dsaflow/serve/http/), which balances requests over the
replicas (parallel.dp) and talks to each worker over one local connection (`multiprocessing.connection`,
authenticated with a key only the parent and its workers hold).

Same ticks everywhere: every rank of a pipeline runs the same scheduler, so all of them must see a request join
(or leave) at the same tick. Only pipeline rank 0 of a replica reads requests from the parent; at the start of
every tick (`OnlineScheduler.pick`, before the pass is chosen) it hands what arrived since the last tick to the
other ranks of its pipeline in one broadcast (`Tidings`), and every rank applies the same news before picking.
When nothing is left to run, the ranks wait together in the same broadcast (rank 0 wakes every `IDLE_WAIT_S` to
say "nothing yet").

What travels, parent -> rank 0 (then to every rank of the pipeline):
    ("add", request id, prompt ids, max_tokens, (key, temperature bits, top_p bits), wants logprobs)
    ("cancel", request id)                                                             the client left, or a stop
    ("stop",)                                                                          cancel everything, exit 0
Each rank -> parent: ("ready", global rank) once its graphs are captured; the last stage's rank, after every pass,
("tokens", [(request, token index, token, logprob, top token, top logprob)], [ended requests], queued, running);
("stats", global rank, busy fraction, tokens) after every busy period (a run of ticks from idle to idle).
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import threading
import time
from multiprocessing.connection import Client
from typing import Dict, List, Optional, Tuple

import torch

from ..pipeline.ticks import Timeline
from .passes import Request
from .scheduler import Scheduler

ADDRESS_ENV, KEY_ENV = "DSAFLOW_SERVE_ADDRESS", "DSAFLOW_SERVE_KEY"  # set by the parent for its workers
IDLE_WAIT_S = 0.5  # an idle rank 0 says "nothing yet" this often, so its peers' broadcast never times out
KEY_SPACE = 1 << 39  # a sampling key id x 2^24 + token index stays an int63 (dsaflow.serve.sampling.TOKEN_KEY)


def float_bits(x: float) -> int:
    """A float as the int64 of its float64 bits (how per-request sampling settings travel in int64 uploads)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def sampling_key(seed: Optional[int], request_id: int) -> int:
    """The key a request's sampling draws from: its seed (same seed, same prompt -> same tokens), else its id."""
    return (seed if seed is not None else (1 << 38) + request_id) % KEY_SPACE


class Tidings:
    """One replica's news, the same on every rank of its pipeline each tick. inbox: rank 0's queue of messages from
    the parent (None on the others); group: the pipeline's gloo group (None: a one-rank pipeline, nothing to send)."""

    def __init__(self, inbox: Optional[queue.Queue], group, src: int):
        self.inbox, self.group, self.src = inbox, group, src
        self.size = torch.zeros(1, dtype=torch.long)

    def exchange(self, wait_s: float = 0.0) -> List[tuple]:
        """What arrived since the last call (rank 0 waits up to wait_s for the first message); the same list on
        every rank of the pipeline."""
        news: List[tuple] = []
        if self.inbox is not None:
            try:
                news.append(self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait())
                while True:
                    news.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
        if self.group is None:
            return news
        import torch.distributed as dist

        payload = pickle.dumps(news) if news else b""
        self.size[0] = len(payload)
        dist.broadcast(self.size, src=self.src, group=self.group)
        n = int(self.size[0])
        if n == 0:
            return []
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.inbox is not None else None
        buf = buf if buf is not None else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=self.src, group=self.group)
        return news if self.inbox is not None else pickle.loads(buf.numpy().tobytes())


class OnlineScheduler(Scheduler):
    """The scheduler of a serving engine whose requests arrive live: before each pick it applies the tick's
    tidings (`apply`). `key_ids` is the engine's request -> sampling triple map (filled as requests join)."""

    tidings: Tidings
    key_ids: Dict[int, Tuple[int, int, int]]
    stopping: bool = False
    logprob_ids: set

    def pick(self, busy):
        news = self.tidings.exchange()
        if news:
            self.apply(news)
        return super().pick(busy)

    def apply(self, news: List[tuple]) -> None:
        for item in news:
            if item[0] == "add":
                _, rid, prompt, max_new, key, logprobs = item
                self.key_ids[rid] = key
                if logprobs:
                    self.logprob_ids.add(rid)
                self.generated[rid] = 0
                self.queue.append(Request(rid, list(prompt), int(max_new)))
            elif item[0] == "cancel":
                self.cancel(item[1])
            elif item[0] == "stop":
                self.stopping = True
                for rid in [r.index for r in self.queue] + [r.request.index for g in self.rows for r in g if r]:
                    self.cancel(rid)

    def cancel(self, rid: int) -> None:
        """Drop request rid: out of the queue, or out of its row (a pass of it in flight emits nothing more)."""
        self.queue = type(self.queue)(r for r in self.queue if r.index != rid)
        for g, rows in enumerate(self.rows):
            for i, row in enumerate(rows):
                if row is not None and row.request.index == rid:
                    self._free(g, i)
        self.forget(rid)

    def forget(self, rid: int) -> None:
        self.generated.pop(rid, None)
        self.key_ids.pop(rid, None)
        self.logprob_ids.discard(rid)

    def idle(self) -> bool:
        return not self.queue and all(r is None for g in self.rows for r in g)

    def running(self) -> int:
        return sum(r is not None for g in self.rows for r in g)


class TokenStream:
    """The last stage's rank: each pass's sampled tokens (and top-1 log-probabilities) to the parent.

    On a GPU the values of a pass are copied to pinned memory without waiting and sent at the next pass (or when the
    replica goes idle), one pass late, as the EOS flags are read (dsaflow/serve/eos.py): the host never waits for
    its GPU to stream. On a CPU they are sent at once."""

    def __init__(self, engine, scheduler: OnlineScheduler, send):
        self.engine, self.scheduler, self.send = engine, scheduler, send
        self.cuda = engine.device.type == "cuda"
        self.reported = 0  # the running rows last sent
        self.pending = None  # (emit, done, host values [rows, 4], copy event) of the pass not sent yet

    def idle(self) -> None:
        """The end of a busy period: send what is pending, and rows freed by cancellations since the last pass."""
        self(None, None, [])

    def __call__(self, p, message, done: List[int]) -> None:
        ready = [] if self.pending is None else [self.pending]  # GPU: the previous pass, copied by now
        self.pending = None
        if p is not None and p.emit and message is not None:  # before `forget`: a request's last token counts
            wanted = any(e[2] in self.scheduler.logprob_ids for e in p.emit)
            # [rows, 4] float64: token, its logprob, top token, top logprob; [rows, 1] when none asked for them
            values = self._values(p, message) if wanted else message[:, :1].double()
            if self.cuda:
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
                self.pending = (list(p.emit), list(done), host, copied)
            else:
                ready.append((list(p.emit), list(done), values, None))
            done = []
        for rid in done:
            self.scheduler.forget(rid)
        running = sum(r is not None for g in self.scheduler.rows for r in g)
        if done or (not ready and running != self.reported):  # a cancelled row frees with no token: say so too
            ready.append(([], list(done), None, None))
        for emit, ended, values, copied in ready:
            if copied is not None:
                copied.synchronize()  # long done: the next pass has run since
            rows = values.tolist() if values is not None else []
            out = [
                (rid, k, int(v[0]), *((v[1], int(v[2]), v[3]) if len(v) == 4 and v[1] == v[1] else (None,) * 3))
                for r, _, rid, k in emit
                for v in (rows[r],)
            ]
            for rid in ended:
                self.scheduler.forget(rid)
            self.reported = running
            self.send(("tokens", out, ended, len(self.scheduler.queue), running))

    def _values(self, p, message) -> torch.Tensor:
        rows = message.shape[0]
        tok = message[:, 0].double()
        values = torch.full((rows, 4), float("nan"), dtype=torch.float64, device=message.device)
        values[:, 0] = tok
        picked = self.engine.picked
        if picked is not None and picked.shape[0] >= rows:
            lp = torch.log_softmax(picked[:rows].float(), dim=-1)
            top_lp, top_tok = lp.max(dim=-1)
            values[:, 1] = lp.gather(1, message[:, :1]).squeeze(1).double()
            values[:, 2], values[:, 3] = top_tok.double(), top_lp.double()
        return values


def forget_done(scheduler: OnlineScheduler):
    """Every other rank: drop the bookkeeping of requests that ended."""

    def on_pass(p, message, done: List[int]) -> None:
        for rid in done:
            scheduler.forget(rid)

    return on_pass


# A busy period is summarised window by window: a server that is never idle would otherwise keep every tick's
# marks (on a GPU, CUDA events) of its whole busy period. 2048 ticks are a few seconds of decode.
TIMELINE_WINDOW_TICKS = 2048


def busy_period(engine, scheduler: OnlineScheduler, is_last: bool, report=None) -> dict:
    """Tick until nothing is queued, running or in flight (what `PipelineEngine.generate` does for a batch). Every
    TIMELINE_WINDOW_TICKS ticks and at the end, the window's stats (busy fractions, tokens) go to
    report(stats, seconds), and the next window starts a fresh timeline. -> the last window's stats."""
    engine.logits_log, engine.first_mark, engine.last_mark = {}, {}, {}
    with engine._on_device():
        engine._start_run(0, 0, is_last)
        scheduler.start_clock()
        t, more = 0, True
        while more:
            engine.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
            window_start, t0 = t, time.perf_counter()
            engine.timeline.begin()
            while (more := engine._tick(t)) and t - window_start < TIMELINE_WINDOW_TICKS:
                t += 1
            t += more  # the tick that ended a full window ran
            stats = _window_stats(engine, t - window_start)
            if report is not None:
                report(stats, time.perf_counter() - t0)
            if more:
                engine.timeline = Timeline(engine.device, len(engine.schedule.segments))
    return stats


def _window_stats(engine, ticks: int) -> dict:
    """The stats of the timeline's window of `ticks` ticks. Per-request latencies are the front end's to measure (a
    request's marks may belong to an earlier window), so none are read here."""
    engine.timeline.end = engine.timeline.mark()
    tl = engine.timeline.resolve()
    engine.first_mark, engine.last_mark = {}, {}
    engine._summarise(tl, ticks, [])
    return engine.stats


def pipeline_gloo_group(ctx):
    """A gloo group over this replica's pipeline ranks (CPU tensors: the tidings never touch a GPU stream); every
    rank of the world creates every replica's group, in the same order. None for a one-rank pipeline."""
    import torch.distributed as dist

    n = ctx.plan.pipeline.ranks
    if n == 1:
        return None
    mine = None
    for d in range(ctx.dp):
        ranks = [d * n + r for r in range(n)]
        g = dist.new_group(ranks, backend="gloo")
        if d == ctx.dp_rank:
            mine = g
    return mine


def connect_parent():
    """This worker's connection to the `dsaflow serve` parent and a lock around its sends."""
    host, port = os.environ[ADDRESS_ENV].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV]))
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    return conn, send


def read_parent(conn, inbox: queue.Queue) -> None:
    """Rank 0's reader thread: every message from the parent into the inbox; the parent gone -> stop."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("stop",))


def run_online(ctx) -> None:
    """The worker's serve job: build and capture this rank's engine, then serve busy periods until told to stop."""
    from .generate import build_engine, check_serve_model

    cfg, plan = ctx.cfg, ctx.plan
    check_serve_model(cfg, plan, ctx.device.type, hf_headers=False)
    me = ctx.global_rank(ctx.rank)
    link = None
    if ctx.world_size > 1:
        from dsaflow.pipeline.p2p import StageLink

        link = StageLink(ctx.device)
        link.warm_up()
    group = pipeline_gloo_group(ctx)
    engine = build_engine(cfg, plan, ctx.rank, ctx.device, link, peer=ctx.global_rank, per_request_sampling=True)
    report = engine.capture()
    if report.records:
        print(report.render(), flush=True)
    report.write_json(str(ctx.run_dir))
    conn, send = connect_parent()
    inbox: Optional[queue.Queue] = None
    if ctx.rank == 0:
        inbox = queue.Queue()
        threading.Thread(target=read_parent, args=(conn, inbox), daemon=True).start()
    is_last = engine.owner[engine.last] == ctx.rank
    engine.key_ids, engine.arrivals = {}, None
    scheduler = engine._scheduler([], kind=OnlineScheduler)
    scheduler.tidings = Tidings(inbox, group, ctx.global_rank(0))
    scheduler.key_ids, scheduler.logprob_ids = engine.key_ids, set()
    engine.scheduler = scheduler
    engine.on_pass = TokenStream(engine, scheduler, send) if is_last else forget_done(scheduler)
    send(("ready", me))
    while True:
        scheduler.apply(scheduler.tidings.exchange(wait_s=IDLE_WAIT_S))
        if is_last:
            engine.on_pass.idle()  # a cancellation may have freed a row outside any pass
        if scheduler.idle():
            if scheduler.stopping:
                break
            continue

        def report(stats: dict, seconds: float) -> None:
            send(("stats", me, float(stats.get("busy_fraction", 0.0)), int(stats.get("tokens", 0)), seconds))

        busy_period(engine, scheduler, is_last, report)
        if is_last:
            engine.on_pass.idle()
        if scheduler.stopping and scheduler.idle():
            break
    conn.close()
