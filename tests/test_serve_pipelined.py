"""Pipelined serving on CPU with a trained checkpoint: greedy tokens are identical across pipeline=single / pp2 /
pp4 and across serve.microbatches=1 / the default (one group per rank), in one process and through torchrun + gloo;
S layers read only their own group's indices; continuous batching refills finished rows."""

import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest

from dsaflow.config.compose import compose
from dsaflow.model.cache import IndexSlot
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.num_layers=8", "index.pattern=FS", "track=none"]
SERVE = ["serve.max_batch=8", "serve.max_context=96", "serve.prefill_chunk=16", "serve.max_new_tokens=12"]
PIPELINES = ("single", "pp2", "pp4")


def cli(*args, timeout=600):
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # 2 to 4 gloo ranks on a 2-core machine: no oversubscription
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def train_checkpoint(run, *extra, steps=150):
    """Train the tiny model briefly into `run` (a run dir) -> run; `extra`: more overrides (train.device=cpu)."""
    res = cli(
        "train",
        *MODEL,
        "data=text",
        f"data.path={REPO}/docs/serving.md",
        f"train.steps={steps}",
        "train.seq_len=64",
        "train.batch_size=16",
        "train.eval_every=0",
        "train.warmup_steps=10",
        "train.lr=5e-3",
        "pipeline.microbatches=1",
        f"run_dir={run}",
        *extra,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run


# The shared checkpoint's steps: enough for what its tests need of a trained model (workload()'s 64 greedy outputs hold
# 41 distinct ones, dense, and 42, MoE, where the tests ask for more than 32; a space byte ends about 50 of them early,
# where the EOS tests ask for 16), at half the cost of 150 steps (loss about 2.85 instead of 2.6).
SHARED_STEPS = 80


def shared_checkpoint(tmp_path_factory, *extra):
    """`train_checkpoint(run, *extra)` once per test session: the test files that serve the same briefly trained
    model (this one, test_serve_mixed.py, test_moe_serve.py) share its run dir across xdist workers, under a file
    lock in their common temp root, instead of each training it again (a minute or two each on a 2-core CPU). The
    run dir is only read by the tests that take it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder = root / ("trained-" + "-".join(e.replace("=", "_").replace("/", "_") for e in extra or ("default",)))
    with FileLock(str(folder) + ".lock"):
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            train_checkpoint(folder / "run", *extra, steps=SHARED_STEPS)
            (folder / "done").touch()
    return folder / "run"


def generate_cli(tmp_path, name, pipeline, checkpoint, prompts, limits, *overrides):
    """`dsaflow generate pipeline=<pipeline>` of `prompts` (each with its max_new_tokens, from a JSONL file) with the
    tiny model of `checkpoint`, run dir tmp_path/name -> (output rows, the finished process)."""
    pf, out = tmp_path / f"{name}-prompts.jsonl", tmp_path / f"{name}.jsonl"
    lines = [json.dumps({"prompt": bytes(p).decode("ascii"), "max_new_tokens": m}) for p, m in zip(prompts, limits)]
    pf.write_text("".join(line + "\n" for line in lines))
    res = cli(
        "generate",
        f"pipeline={pipeline}",
        *MODEL,
        *SERVE,
        *overrides,
        f"serve.checkpoint={checkpoint}",
        f"serve.prompts_file={pf}",
        f"serve.output_file={out}",
        f"run_dir={tmp_path / name}",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], res


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained briefly on a doc of the repo (bytes, loss about 2.85): its greedy continuations differ from
    prompt to prompt and its next-token distributions are peaked, unlike the random init's near-ties."""
    return shared_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_ref(trained):
    """workload()'s 64 prompts and the trained model's greedy tokens for them, one process, one group: the reference
    of the two tests below, computed once."""
    prompts, limits = workload()
    return prompts, limits, engine(trained, "single", 1).generate(prompts, limits)


def workload(n=64, seed=0):
    """n prompts cut from the docs, lengths log-uniform in [1, 64], each with its own max_new_tokens in [1, 12]."""
    rng = random.Random(seed)
    text = bytes(b if b < 128 else 32 for b in open(os.path.join(REPO, "docs", "training.md"), "rb").read())
    prompts, limits = [], []
    for _ in range(n):
        L = int(math.exp(rng.uniform(0, math.log(64))))
        start = rng.randrange(0, len(text) - L)
        prompts.append(list(text[start : start + L]))
        limits.append(rng.randint(1, 12))
    return prompts, limits


def eos_cut(ref, at_least):
    """A byte that ends many greedy outputs early -> (that byte, each output cut after its first occurrence); at
    least `at_least` outputs must end early, or the EOS tests would test little."""
    eos = max(range(128), key=lambda b: sum(b in o[:-1] for o in ref))
    cut = [o[: o.index(eos) + 1] if eos in o else o for o in ref]
    assert sum(len(c) < len(o) for c, o in zip(cut, ref)) >= at_least
    return eos, cut


def engine(run, pipeline, microbatches=None, extra=()):
    """An in-process engine running every stage (run None: the seeded random init)."""
    mb = [] if microbatches is None else [f"serve.microbatches={microbatches}"]
    ckpt = [] if run is None else [f"serve.checkpoint={run}"]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, *ckpt, *mb, *extra])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    return eng


@pytest.mark.slow
def test_greedy_tokens_identical_across_pipelines_and_groups(trained, trained_ref):
    prompts, limits, ref = trained_ref
    assert [len(o) for o in ref] == limits
    assert len({tuple(o) for o in ref}) > 32  # the trained model does not say one thing to everyone
    for pipeline in PIPELINES:
        for mb in (1, None):
            eng = engine(trained, pipeline, mb)
            assert eng.groups == (1 if mb == 1 else {"single": 1, "pp2": 2, "pp4": 4}[pipeline])
            if pipeline == "single":  # one stage, one group either way: the configuration `ref` was served with
                continue
            assert eng.generate(prompts, limits) == ref, (pipeline, mb)


@pytest.mark.slow
def test_eos_ends_rows_one_pass_late_and_keeps_the_tokens(trained, trained_ref):
    """serve.eos_id: the flags are applied one pass of the group late (Scheduler.end), so a row that emitted EOS runs
    once more and refills later; the output of every request is still its greedy tokens up to and with its first
    EOS, in every pipeline and group count."""
    prompts, limits, ref = trained_ref
    eos, cut = eos_cut(ref, 16)
    for pipeline, mb in (("single", 1), ("pp2", None), ("pp4", None)):
        eng = engine(trained, pipeline, mb, [f"serve.eos_id={eos}"])
        assert eng.generate(prompts, limits) == cut, (pipeline, mb)
        assert eng.stats["tokens"] == sum(map(len, cut))  # the dropped tokens past EOS are not counted


@pytest.mark.slow
def test_torchrun_pp2_and_pp4_serve_the_same_tokens(trained, tmp_path):
    """Real ranks (gloo, one process per stage), groups in flight, per-request limits from the JSONL: pp2 serves the
    one-process tokens; pp4 serves them with serve.eos_id set (one launch for both checks: a start of 4 ranks costs
    seconds of imports each), so every rank also receives the EOS flags and applies them one pass late, at the same
    point: the ranks must still build the same passes (a mismatch would hang or fail the transfers), and each output
    is the reference up to and with its first EOS (the outputs without one, whole)."""
    prompts, limits = workload(24, seed=1)
    ref = engine(trained, "single", 1).generate(prompts, limits)
    eos, cut = eos_cut(ref, 4)
    for pipeline, extra, want in (("pp2", (), ref), ("pp4", (f"serve.eos_id={eos}",), cut)):
        rows, res = generate_cli(tmp_path, pipeline, pipeline, trained, prompts, limits, *extra)
        assert [r["num_tokens"] for r in rows] == [len(w) for w in want], pipeline
        assert all(r["ttft_s"] > 0 for r in rows)
        assert [r["tokens"] for r in rows] == want, pipeline
        assert "requests done" in res.stdout  # the progress lines of the last stage's rank


def test_s_layers_read_only_their_groups_indices(monkeypatch):
    """Every index read returns a view inside its own group's rows of the stage's index cache, and poisoning every
    other group's index rows before each pass changes no token."""
    prompts, limits = workload(16, seed=2)
    clean = engine(None, "pp2", 2).generate(prompts, limits)
    eng = engine(None, "pp2", 2)
    reads = []
    real_read = IndexSlot.read

    def first_row(t, s):
        full = eng.caches[s].index
        return (t.data_ptr() - full.data_ptr()) // (full.stride(0) * full.element_size())

    def checked_read(self, layer, source):
        got = real_read(self, layer, source)
        s = next(
            s
            for s, c in eng.caches.items()
            if c.index.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        )
        slot_row = first_row(self.buffer, s)
        a, b = next((a, b) for a, b in eng.ranges if a <= slot_row < b)  # the group this slot belongs to
        row = first_row(got, s)
        assert a <= row and row + got.shape[0] <= b  # the indices read lie in the group's own rows
        reads.append((s, a))
        return got

    monkeypatch.setattr(IndexSlot, "read", checked_read)
    inner = eng._forward

    def poisoned(item, stage, x):
        a, b = eng.ranges[item.group]
        full = eng.caches[stage].index
        full[:a].fill_(10**6)  # out of range: reading it would fail or change the output
        full[b:].fill_(10**6)
        return inner(item, stage, x)

    eng._forward = poisoned
    assert eng.generate(prompts, limits) == clean
    assert {a for _, a in reads} == {0, 4}  # both groups' S layers read, each from its own rows


def test_continuous_batching_refills_rows():
    """With 2 rows and 6 requests of different limits, finished rows take the next request while the other row keeps
    decoding: the tokens equal serving each request alone, and there are fewer passes than batch after batch."""
    prompts, limits = workload(6, seed=3)
    limits = [12, 1, 3, 12, 2, 5]
    eng = engine(None, "single", 1, ["serve.max_batch=2", "serve.batching=continuous"])
    got = eng.generate(prompts, limits)
    alone = [engine(None, "single", 1, ["serve.max_batch=1"]).generate([p], [m])[0] for p, m in zip(prompts, limits)]
    assert got == alone
    fixed_passes = sum(
        max(math.ceil(len(p) / 16) for p in prompts[i : i + 2]) + max(limits[i : i + 2]) - 1 for i in range(0, 6, 2)
    )
    assert eng.stats["ticks"] < fixed_passes


def test_eager_refills_rearrange_rows_and_keep_every_token():
    """Eager continuous batching, 8 rows, 20 requests of mixed prompt lengths and limits: refills move the decoding
    rows down (cached rows on both stages, the previous tokens on stage 0), and every request's tokens equal serving
    it alone."""
    prompts, _ = workload(20, seed=4)
    limits = [1 + (7 * i) % 12 for i in range(20)]
    eng = engine(None, "pp2", 1, ["serve.max_batch=8", "serve.batching=continuous"])
    seen = []
    inner = eng._prepare

    def spy(p):
        if p.moves:
            seen.append(p.moves)
        return inner(p)

    eng._prepare = spy
    got = eng.generate(prompts, limits)
    assert seen  # some refill moved rows that were already decoding
    alone = engine(None, "single", 1, ["serve.max_batch=1"])
    assert got == [alone.generate([p], [m])[0] for p, m in zip(prompts, limits)]


@pytest.fixture(scope="module")
def alone_24_seed5():
    """workload(24, seed=5) with limits 1 + 5i mod 12, and each request served alone (one row, no graphs) by the
    seeded random init: the reference of both pipelines below, computed once (24 one-row runs)."""
    prompts, _ = workload(24, seed=5)
    limits = [1 + (5 * i) % 12 for i in range(24)]
    alone = engine(None, "single", 1, ["serve.max_batch=1"])
    return prompts, limits, [alone.generate([p], [m])[0] for p, m in zip(prompts, limits)]


@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_continuous_batching_with_prefill_graphs_prefills_the_top_rows(pipeline, alone_24_seed5):
    """Continuous batching with prefill graphs (a fake capturer, which replays like a graph): refills rearrange the
    rows (their cached rows on every stage, decoding rows down, prefilling ones up), joiners prefill through graphs
    over the group's top rows, and every request's tokens equal serving it alone."""
    from test_graphs_cpu import FakeCapturer

    from dsaflow.model.cache import StageCache

    prompts, limits, want = alone_24_seed5
    graphs = [
        "graphs=decode_prefill",
        "graphs.blocks.0.shape_classes=[1,2,4,8]",
        "graphs.blocks.1.shape_classes=[4,16]",
    ]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, "serve.batching=continuous", *graphs])
    if pipeline == "pp2":
        cfg.graphs.blocks[0].shape_classes = [1, 2, 4]  # two groups of 4 rows
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True, capturer=FakeCapturer())
    eng.capture()
    group_rows = 8 // eng.groups
    assert eng.row_classes == tuple(sorted({max(1, group_rows // d) for d in (8, 4, 2)} | {group_rows}))
    names, moves = [], []
    real_run, real_move = eng.graphs.run, StageCache.move_rows

    def run(name, stage, n, inputs):
        names.append(name)
        return real_run(name, stage, n, inputs)

    def move(self, src, dst, length=None):
        moves.append((src.tolist(), dst.tolist()))
        assert length is not None and 0 < length <= self.max_context  # a prefix of the rows, not whole rows
        return real_move(self, src, dst, length)

    eng.graphs.run = run
    StageCache.move_rows = move
    try:
        got = eng.generate(prompts, limits)
    finally:
        StageCache.move_rows = real_move
    assert moves and all(len(set(dst)) == len(dst) and set(src) != set(dst) for src, dst in moves)
    assert any("/r" in n for n in names)  # some prefill replayed a graph over fewer rows than the group
    assert got == want


@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_last_stage_decode_graphs_sample_like_the_eager_path(pipeline):
    """The last stage's decode graphs sample inside the graph (a fake capturer, which replays like a graph): with
    temperature, top-p and an EOS byte, every request's tokens equal the eager engine's, and the graph's output is
    the sampled message itself."""
    from test_graphs_cpu import FakeCapturer

    prompts, _ = workload(16, seed=11)
    limits = [2 + (3 * i) % 10 for i in range(16)]
    sampling = ["serve.temperature=0.9", "serve.top_p=0.8", "serve.seed=3", "serve.eos_id=101"]
    classes = "[1,2,4,8]" if pipeline == "single" else "[1,2,4]"  # pp2: two groups of 4 rows
    graphs = ["graphs=decode", f"graphs.blocks.0.shape_classes={classes}"]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, *sampling, *graphs])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True, capturer=FakeCapturer())
    eng.capture()
    outputs, real_run = [], eng.graphs.run

    def run(name, stage, n, inputs):
        out = real_run(name, stage, n, inputs)
        if stage == eng.last:
            outputs.append(out)
        return out

    eng.graphs.run = run
    got = eng.generate(prompts, limits)
    assert outputs and all(isinstance(o, tuple) and o[0].shape == (o[1].shape[0], 2) for o in outputs)
    want = engine(None, pipeline, None, sampling).generate(prompts, limits)  # graphs off: sampled eagerly
    assert got == want
    assert any(len(o) < m for o, m in zip(got, limits))  # some rows ended at the EOS byte


def test_decode_transfers_replayed_from_graphs_serve_the_same_tokens():
    """graphs.transfers on pp2 (two ranks as threads joined by an in-memory link; graphs and transfer graphs faked
    like a capture: recorded, then replayed): decode ticks replay their transfers, padded to the decode classes,
    from a few captures, and every request's tokens (sampled, with an EOS byte; stage 1 opens on S, so cross-stage
    indices travel with the activations) equal one process serving both stages."""
    import queue

    from test_graphs_cpu import FakeCapturer
    from test_ticks import QueueLink, RecordingCapturer, run_ranks

    prompts, _ = workload(16, seed=13)
    limits = [2 + (5 * i) % 11 for i in range(16)]
    extra = ["serve.temperature=0.9", "serve.seed=5", "layout=FSSS|SFSS", "graphs=decode"]
    extra += ["graphs.blocks.0.shape_classes=[1,2,4]", "graphs.transfers=true", "pipeline.cross_stage_indices=true"]
    cfg = compose(["mode=serve", "pipeline=pp2", "model.num_layers=8", "track=none", *SERVE, *extra])
    plan = build_plan(cfg)

    def one_process():
        eng = build_engine(cfg, plan, 0, "cpu", all_stages=True, capturer=FakeCapturer())
        eng.capture()
        return eng.generate(prompts, limits)

    later = [t for o in one_process() for t in o[1:]]
    cfg.serve.eos_id = max(set(later), key=later.count)  # a byte that ends several rows early
    queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    engines, got = {}, {}

    def rank_main(rank):
        eng = build_engine(cfg, plan, rank, "cpu", link=QueueLink(rank, queues), capturer=FakeCapturer())
        eng.transfer_capturer = RecordingCapturer()
        eng.capture()
        engines[rank] = eng
        got[rank] = eng.generate(prompts, limits)

    run_ranks((0, 1), rank_main, timeout=300)
    assert got[0] is None and got[1] == one_process()
    assert any(len(o) < m for o, m in zip(got[1], limits))  # EOS ended some rows
    for eng in engines.values():
        tg = eng.transfers
        assert tg is not None and tg.eager_ticks == 0
        assert 0 < tg.captures <= 3 * 3 * 3 and tg.replays > 2 * tg.captures  # shapes of 3 classes recur


def test_host_bound_hint_only_when_the_gpu_waited_on_its_host_with_groups():
    from dsaflow.serve.generate import host_bound_hint

    host = {"pick": 0.1, "stage": 0.2, "exchange": 0.2, "feedback": 0.05}
    late = {"decode_host_late": 0.67, "decode_host_ms_per_tick": host}
    hint = host_bound_hint(late, groups=4, rank=3)
    assert hint.startswith("[rank 3] note:") and "67%" in hint and "0.55 ms" in hint and "serve.microbatches=1" in hint
    assert host_bound_hint(late, groups=1, rank=3) is None  # one group: idle by design, nothing to say
    assert host_bound_hint({**late, "decode_host_late": 0.2}, groups=4, rank=3) is None
    assert host_bound_hint({**late, "decode_host_late": None}, groups=4, rank=3) is None  # CPU: not measured
