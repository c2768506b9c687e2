"""Serving CUDA graphs on real devices. Skipped without GPUs (tests/conftest.py); run on the GPU machines with

    .venv/bin/python -m pytest -q -m "gpu or multigpu" tests/test_graphs_gpu.py

gpu:      graph replay == eager bit for bit over 32 decode steps at several batch sizes (decode + prefill graphs,
          every decode step under set_sync_debug_mode("error")); graphs.cache on vs off bit-identical; sampling
          has no host sync; a dead graph is not freed during another capture; `dsaflow generate` on one GPU captures every requested block and reports it.
multigpu: capture on cuda:1 works like cuda:0 (nothing lands on cuda:0); a 2-stage NCCL pipeline (torchrun, two
          processes) generates the same tokens as one stage.
"""

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine
from dsaflow.serve.graph_manager import GraphManager, StaticInput
from dsaflow.serve.sampling import make_generator, sample_next

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 32  # decode steps compared (max_new_tokens = STEPS + 1: the first token comes from prefill)
BASE = ["mode=serve", "track=none", "serve.max_batch=8", "serve.max_context=192", f"serve.max_new_tokens={STEPS + 1}"]


def make(overrides=(), prefill_chunk=32, cache=True):
    cfg = compose(BASE + ["graphs=decode_prefill", "layout=FSSFFSSS", *overrides])
    cfg.serve.batching = "fixed"  # prefill graphs over all rows; continuous batching's top-row graphs: test_serve_*
    cfg.serve.prefill_chunk = prefill_chunk
    cfg.graphs.blocks[1].shape_classes = [8, prefill_chunk]  # two prefill classes; prompts span several chunks
    cfg.graphs.cache = cache
    return cfg, build_plan(cfg)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 70, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


def run(cfg, plan, ps, device="cuda:0", force_eager=False, strict=False):
    eng = build_engine(cfg, plan, 0, device, all_stages=True, force_eager=force_eager)
    report = eng.capture()
    eng.record_logits, eng.strict_sync = True, strict
    out = eng.generate(ps)
    return out, eng, report


def assert_bitwise(log_a, log_b):
    """The engines' logits logs {request: [V] per generated token} are equal bit for bit, STEPS + 1 per request."""
    assert sorted(log_a) == sorted(log_b) and log_a
    for req in log_a:
        assert len(log_a[req]) == len(log_b[req]) == STEPS + 1
        for step, (a, b) in enumerate(zip(log_a[req], log_b[req])):
            assert torch.equal(a.cpu(), b.cpu()), (
                f"request {req}: logits differ at step {step}: max |d| {(a.cpu() - b.cpu()).abs().max()}"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("n,sampling", [(1, False), (3, False), (5, True), (8, False)])
def test_graph_replay_equals_eager_bitwise(n, sampling):
    extra = ["serve.temperature=0.8", "serve.top_p=0.9"] if sampling else []
    cfg, plan = make(extra)
    ps = prompts(n, seed=n)
    out_g, eg, report = run(cfg, plan, ps, strict=True)  # every decode step: sync debug mode "error"
    assert [(r.status, r.device) for r in report.records] == [("captured", "cuda:0")] * (4 + 2)
    captures = eg.graphs.captures
    out_e, ee, _ = run(cfg, plan, ps, force_eager=True)
    assert_bitwise(eg.logits_log, ee.logits_log)
    assert out_g == out_e
    assert eg.graphs.captures == captures  # replays only: nothing captured while generating
    assert all(len(o) == STEPS + 1 for o in out_g)


@pytest.mark.gpu
def test_graph_cache_on_and_bypass_are_bit_identical():
    ps = prompts(6, seed=1)
    out_on, e_on, _ = run(*make(cache=True), ps)
    out_off, e_off, _ = run(*make(cache=False), ps)
    assert_bitwise(e_on.logits_log, e_off.logits_log)
    assert out_on == out_off
    assert e_off.graphs.captures > e_on.graphs.captures + STEPS  # the bypass recaptured on every call


@pytest.mark.gpu
def test_sampling_makes_no_host_sync():
    logits = torch.randn(8, 256, device="cuda")
    gen = make_generator("cuda", 0)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for temperature, top_p in ((0.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
            sample_next(logits, temperature, top_p, gen)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def dsaflow_generate(tmp_path, *overrides, prompts_list):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts_list))
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-c",
        "from dsaflow.cli import main; main()",
        "generate",
        *BASE,
        *overrides,
        f"serve.prompts_file={pf}",
        f"serve.output_file={out}",
        f"run_dir={tmp_path / 'run'}",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()], res.stdout


TEXT_PROMPTS = ["The quick brown fox", "DSA layers share indices", "x", "pipeline stages on two GPUs"]


@pytest.mark.gpu
def test_a_dead_graph_is_not_freed_while_another_captures():
    """A dropped GraphManager held only by a reference cycle, and Python allocations (which trigger collections)
    during another manager's capture: the capture succeeds, and the dead graph is freed after it, not during it.
    (Freeing a graph while a stream captures fails that capture, dsaflow/pipeline/capture_guard.py.)"""
    dev = torch.device("cuda", torch.cuda.current_device())
    spec = {"x": StaticInput((8, 1), torch.float32, 0)}
    old = GraphManager(dev)
    old.register("b", "decode", 0, (8,), 0, lambda v: v["x"] * 2, spec)
    old.capture_all()
    held, freed_while_capturing = {"old": old}, []
    weakref.finalize(old, lambda: freed_while_capturing.append(torch.cuda.is_current_stream_capturing()))
    del old
    thresholds = gc.get_threshold()

    def fn(v):
        if torch.cuda.is_current_stream_capturing() and "old" in held:
            cycle = [held.pop("old")]
            cycle.append(cycle)  # dead once fn returns: only a collection frees it
            gc.set_threshold(1, 1, 1)  # a collection of every generation at almost every allocation
            try:
                junk = [[i] for i in range(5000)]
            finally:
                gc.set_threshold(*thresholds)
            del cycle, junk
        return v["x"] * 3

    new = GraphManager(dev)
    new.register("b", "decode", 0, (8,), 0, fn, spec)
    new.capture_all()
    x = torch.arange(8, device=dev, dtype=torch.float32).reshape(8, 1)
    assert torch.equal(new.run("b", 0, 8, {"x": x}), x * 3)
    gc.collect()
    assert freed_while_capturing == [False]


@pytest.mark.gpu
def test_generate_cli_one_gpu_captures_and_reports(tmp_path):
    rows, stdout = dsaflow_generate(tmp_path, "graphs=decode_prefill", "layout=FSSFFSSS", prompts_list=TEXT_PROMPTS)
    assert len(rows) == len(TEXT_PROMPTS) and all(len(r["tokens"]) == STEPS + 1 for r in rows)
    rep = json.loads((tmp_path / "run" / "graphs_rank0.json").read_text())
    # decode 1,2,4,8 + prefill 16,32,64,128 over all 8 rows and over the top 1, 2, 4 rows (continuous batching)
    assert rep["eager"] == 0 and rep["captured"] == 4 + 4 * 4
    assert {r["block"] for r in rep["records"]} == {"decode", "prefill", "prefill/r1", "prefill/r2", "prefill/r4"}
    assert {r["device"] for r in rep["records"]} == {"cuda:0"}
    assert "CUDA graph capture report, rank 0" in stdout


@pytest.mark.multigpu
def test_capture_on_cuda1_like_cuda0():
    cfg, plan = make()
    ps = prompts(4, seed=2)
    out0, e0, _ = run(cfg, plan, ps, device="cuda:0", strict=True)
    gc.collect()
    torch.cuda.synchronize(0)
    before0 = torch.cuda.memory_allocated(0)
    out1, e1, report1 = run(cfg, plan, ps, device="cuda:1", strict=True)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0  # the engine guarded its device; the process's current device is 0
    assert [(r.status, r.device) for r in report1.records] == [("captured", "cuda:1")] * (4 + 2)
    assert torch.cuda.memory_allocated(0) <= before0  # nothing of the cuda:1 engine landed on cuda:0
    assert torch.cuda.memory_reserved(1) > 0
    assert all(t.device == torch.device("cuda:1") for log in e1.logits_log.values() for t in log)
    assert_bitwise(e0.logits_log, e1.logits_log)
    assert out0 == out1


@pytest.mark.multigpu
def test_two_stage_nccl_pipeline_equals_one_stage(tmp_path):
    # 16 rows: two groups of 8 in flight (decode classes up to 8 per group)
    common = ["graphs=decode_prefill", "serve.temperature=0.8", "serve.top_p=0.9", "serve.seed=7", "serve.max_batch=16"]
    rows, stdout = dsaflow_generate(tmp_path, *common, "layout=FSSF|FSSS", prompts_list=TEXT_PROMPTS)
    for r in (0, 1):
        rep = json.loads((tmp_path / "run" / f"graphs_rank{r}.json").read_text())
        assert rep["eager"] == 0 and {x["device"] for x in rep["records"]} == {f"cuda:{r}"}
        assert {x["stage"] for x in rep["records"]} == {r}
    cfg = compose(BASE + [*common, "layout=FSSFFSSS", "serve.microbatches=2"])  # the same rows per pass
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0")
    eng.capture()
    want = eng.generate([list(p.encode()) for p in TEXT_PROMPTS])
    assert [r["tokens"] for r in rows] == want
