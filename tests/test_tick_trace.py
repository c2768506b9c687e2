"""A decode tick a reader can follow: the Python functions the serving engine calls once per generated token,
outside dsaflow/model and dsaflow/ops, stay within 5 files and 25 functions, on one rank and on each rank of pp2.

Measured as a reader would: profile the same request twice, with 8 and then 24 new tokens; a function whose call
count grows by a multiple of the 16 extra tokens runs on every tick (or every pass). Comprehensions and lambdas are
not counted as functions of their own (they are lines of the function they sit in)."""

from __future__ import annotations

import cProfile
import pstats
import queue
from collections import defaultdict

import pytest
from test_ticks import QueueLink, run_ranks

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

MAX_FILES, MAX_FUNCTIONS = 5, 25
SHORT, LONG = 8, 24
PROMPT = [list(b"the quick brown fox")]
CONFIG = ["mode=serve", "track=none", "serve.max_batch=2", "serve.max_context=64", "serve.prefill_chunk=16"]


def per_tick(short: pstats.Stats, long: pstats.Stats, extra: int) -> dict:
    """{file under dsaflow/: [function]} of the functions whose call count grew by a multiple of `extra`."""
    grown = defaultdict(list)
    for (path, line, name), (_, calls, *_rest) in long.stats.items():
        if "/dsaflow/" not in path or name.startswith("<"):
            continue
        room = path.split("/dsaflow/", 1)[1]
        if room.startswith(("model/", "ops/")):
            continue
        before = short.stats.get((path, line, name), (0, 0))[1]  # by line too: two methods may share a name
        delta = calls - before
        if delta >= extra and delta % extra == 0:
            grown[room].append(name)
    return dict(grown)


def profiled_runs(pipeline: str) -> list:
    """[(short stats, long stats)] per rank of `pipeline`, each rank profiled in its own thread."""
    cfg = compose([*CONFIG, f"pipeline={pipeline}"])
    plan = build_plan(cfg)
    ranks = range(plan.pipeline.ranks)
    queues = {(a, b): queue.Queue() for a in ranks for b in ranks if a != b}
    stats = {r: [] for r in ranks}

    def rank_main(rank):
        link = QueueLink(rank, queues) if len(ranks) > 1 else None
        eng = build_engine(cfg, plan, rank, "cpu", link=link)
        eng.capture()
        for new in (SHORT, LONG):
            prof = cProfile.Profile()
            prof.enable()
            eng.generate(PROMPT, [new])
            prof.disable()
            stats[rank].append(pstats.Stats(prof))

    run_ranks(ranks, rank_main, timeout=300)
    return [stats[r] for r in ranks]


@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_a_decode_tick_stays_within_five_files_and_25_functions(pipeline):
    for rank, (short, long) in enumerate(profiled_runs(pipeline)):
        files = per_tick(short, long, LONG - SHORT)
        functions = sum(len(names) for names in files.values())
        assert "serve/engine.py" in files and "_tick" in files["serve/engine.py"]  # the measure sees the tick
        assert len(files) <= MAX_FILES and functions <= MAX_FUNCTIONS, (pipeline, rank, files)


def test_the_count_sees_a_function_called_on_every_tick():
    """The measure itself: a function added to every tick is counted, one called once per run is not."""

    def stats_of(calls_per_run: dict) -> pstats.Stats:
        prof = cProfile.Profile()
        prof.enable()
        prof.disable()
        st = pstats.Stats(prof)
        st.stats = {("/x/dsaflow/serve/engine.py", 1, name): (n, n, 0.0, 0.0, {}) for name, n in calls_per_run.items()}
        return st

    short = stats_of({"_tick": SHORT, "generate": 1, "<listcomp>": SHORT})
    long = stats_of({"_tick": LONG, "generate": 1, "<listcomp>": LONG})
    assert per_tick(short, long, LONG - SHORT) == {"serve/engine.py": ["_tick"]}


def test_an_online_decode_tick_stays_within_five_files_and_25_functions():
    """`dsaflow serve`'s tick (dsaflow/serve/online.py: the tick's news applied before the pick, each pass's tokens
    streamed to the front end) on one rank, greedy requests of their own sampling settings, measured the same way."""
    from dsaflow.serve.online import OnlineScheduler, TokenStream, busy_period, float_bits

    class OneShot:  # the request arrives at the first tick; no news after it
        def __init__(self, item):
            self.items = [[item]]

        def exchange(self, wait_s: float = 0.0):
            return self.items.pop() if self.items else []

    cfg = compose([*CONFIG, "pipeline=single"])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", per_request_sampling=True)
    eng.capture()
    eng.key_ids, eng.arrivals = {}, None
    sched = eng._scheduler([], kind=OnlineScheduler)
    sched.key_ids, sched.logprob_ids = eng.key_ids, set()
    eng.scheduler = sched
    sent = []
    eng.on_pass = TokenStream(eng, sched, sent.append)
    stats = []
    for rid, new in enumerate((SHORT, LONG)):
        greedy = (rid, float_bits(0.0), float_bits(1.0))
        sched.tidings = OneShot(("add", rid, PROMPT[0], new, greedy, False))
        prof = cProfile.Profile()
        prof.enable()
        busy_period(eng, sched, is_last=True)
        prof.disable()
        stats.append(pstats.Stats(prof))
    assert sum(len(m[1]) for m in sent) == SHORT + LONG  # every token streamed
    files = per_tick(*stats, LONG - SHORT)
    functions = sum(len(names) for names in files.values())
    assert "serve/online.py" in files and "_tick" in files["serve/engine.py"]
    assert len(files) <= MAX_FILES and functions <= MAX_FUNCTIONS, files
