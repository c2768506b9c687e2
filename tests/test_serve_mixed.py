"""Mixed passes (serve.max_pass_tokens, dsaflow/serve/mixed.py) on CPU: each pass carries every decoding row's token
and prompt chunks of joining rows up to the token budget; greedy tokens equal serving each request alone whatever
the budget, pipeline, group count, cross-stage indices or MoE; the budget, the decode rows' turn and the chunk sizes
hold pass by pass; bad settings fail with the field, the value and the fix."""

from __future__ import annotations

import time

import pytest
from test_serve_pipelined import engine, generate_cli, shared_checkpoint, workload

from dsaflow.config.compose import compose
from dsaflow.errors import ServeError
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine
from dsaflow.serve.passes import Request
from dsaflow.serve.scheduler import Scheduler, online_arrivals

EAGER = ["serve.short_prefill=false"]  # the reference: today's passes, sparse attention only


def mixed(budget):
    return [f"serve.max_pass_tokens={budget}", *EAGER]


def spy_passes(eng):
    """Record every pass the engine prepares."""
    seen, inner = [], eng._prepare

    def spy(p):
        seen.append(p)
        return inner(p)

    eng._prepare = spy
    return seen


def alone(run, prompts, limits, extra=()):
    """Each request served alone (one row, today's passes)."""
    eng = engine(run, "single", 1, ["serve.max_batch=1", *EAGER, *extra])
    return [eng.generate([p], [m])[0] for p, m in zip(prompts, limits)]


@pytest.fixture(scope="module")
def alone_24():
    """workload(24, seed=6) and each request served alone by the seeded random init: the reference of every case
    below, computed once (24 one-row runs)."""
    prompts, limits = workload(24, seed=6)
    return prompts, limits, alone(None, prompts, limits)


@pytest.mark.parametrize("pipeline,budget", [("single", 24), ("pp2", 40), ("pp2", 200)])
def test_mixed_passes_equal_serving_each_request_alone(pipeline, budget, alone_24):
    prompts, limits, want = alone_24
    eng = engine(None, pipeline, None, mixed(budget))
    seen = spy_passes(eng)
    got = eng.generate(prompts, limits)
    assert got == want
    assert any(p.token_major and any(p.decode) for p in seen)  # decoding rows rode along with prompt chunks
    assert any(p.decode_only for p in seen)  # and decode-only passes stayed what they were
    assert all(p.T <= budget for p in seen)


@pytest.mark.parametrize("pipeline,extra", [("single", mixed(40)), ("pp2", EAGER)])
def test_online_arrivals_keep_the_tokens_and_start_no_request_before_it_arrives(pipeline, extra):
    """Requests arriving over time (generate's arrivals, spaced wider than the whole offline run) get the offline
    run's tokens, and each one's time to first token, counted from its arrival, is positive: a scheduler that let
    them in early would finish the late ones before they arrive."""
    prompts, limits = workload(12, seed=7)
    eng = engine(None, pipeline, None, extra)
    t0 = time.perf_counter()
    offline = eng.generate(prompts, limits)
    gap = (time.perf_counter() - t0) / 4 + 0.01
    arrivals = [gap * i for i in range(len(prompts))]
    t0 = time.perf_counter()
    assert eng.generate(prompts, limits, arrivals=arrivals) == offline
    assert time.perf_counter() - t0 >= arrivals[-1]
    ttft = eng.stats["ttft_s"]
    assert sorted(ttft) == list(range(len(prompts))) and min(ttft.values()) > 0, ttft


def test_bad_arrivals_name_the_fix():
    prompts, limits = workload(3, seed=7)
    eng = engine(None, "single")
    with pytest.raises(ValueError, match="3 prompts; give one per prompt"):
        eng.generate(prompts, limits, arrivals=[0.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        eng.generate(prompts, limits, arrivals=[0.0, 0.2, 0.1])
    with pytest.raises(ValueError, match="every stage in this process"):
        online_arrivals([0.0, 0.1], 2, one_process=False)  # a pipeline across processes


def test_every_pass_keeps_the_budget_and_every_decoding_row_its_token():
    """Scheduler alone: 6 rows, requests longer than the budget; every pass of a group with a prefilling row holds
    each decoding row once, first, then chunks in request order filling the budget (or the prompts' ends)."""
    prompts = [[1] * n for n in (30, 3, 17, 9, 25, 2, 40, 11)]
    reqs = [Request(i, p, 4) for i, p in enumerate(prompts)]
    sched = Scheduler(reqs, [(0, 6)], chunk=16, refill=True, narrow=True, max_pass_tokens=20)
    passes = 0
    while sched.has_work(0):
        rows = sched.rows[0]
        p = sched.next_pass(0)
        passes += 1
        if p.token_major:
            decoding = [i for i, r in enumerate(rows) if r is not None and r.offset >= len(r.request.prompt)]
            assert p.token_rows[: len(decoding)] == decoding  # decode tokens first, one per decoding row
            chunks = p.token_rows[len(decoding) :]
            order = [rows[i].request.index for i in dict.fromkeys(chunks)]
            assert order == sorted(order)  # chunks in request order
            assert all(chunks.count(i) <= 16 for i in set(chunks))  # serve.prefill_chunk per row
            left = sum(len(r.request.prompt) - r.offset for r in rows if r is not None)
            assert p.T == 20 or p.T == len(decoding) + left  # the budget is filled unless the prompts end first
        sched.finish(p)
    assert sched.finished == len(reqs) and passes < 60


def test_greedy_tokens_do_not_depend_on_the_budget():
    prompts, limits = workload(16, seed=7)
    outs = [engine(None, "pp2", None, mixed(b)).generate(prompts, limits) for b in (9, 33, 500)]
    assert outs[0] == outs[1] == outs[2]


def test_cross_stage_indices_in_mixed_passes():
    """pp2 with index.pattern=FSS: stage 1 opens on S layers that read layer 3's indices, sent token-major."""
    extra = ["index.pattern=FSS", "model.index_topk=8", "pipeline.cross_stage_indices=true"]
    prompts, limits = workload(16, seed=8)
    eng = engine(None, "pp2", None, [*extra, *mixed(30)])
    assert any(s.incoming_source is not None for s in eng.stages.values())
    assert eng.generate(prompts, limits) == alone(None, prompts, limits, extra)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["serve.batching=fixed", *mixed(64)], "serve.batching=continuous"),
        (mixed(4), r"serve.max_pass_tokens=5 or more"),
        (["serve.max_pass_tokens=64"], "serve.short_prefill=false"),
        (["graphs=decode_prefill", "serve.max_batch=16", "serve.prefill_chunk=128", *mixed(64)], "graphs=decode"),
    ],
)
def test_bad_mixed_settings_name_the_fix(overrides, match):
    cfg = compose(["mode=serve", "pipeline=pp2", "serve.max_batch=8", "serve.prefill_chunk=16", *overrides])
    with pytest.raises(ServeError, match=match):
        build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)


# --- a trained model: 64 mixed prompts, peaked distributions -------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return shared_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_alone(trained):
    """64 prompts and each one's tokens served alone by the trained model (64 one-row runs, the slow part): the
    reference of both tests below, computed once."""
    prompts, limits = workload()
    return prompts, limits, alone(trained, prompts, limits)


@pytest.mark.slow
def test_trained_64_prompts_single_pp2_pp4_equal_serving_alone(trained, trained_alone):
    prompts, limits, want = trained_alone
    for pipeline in ("single", "pp2", "pp4"):
        assert engine(trained, pipeline, None, mixed(48)).generate(prompts, limits) == want, pipeline


@pytest.mark.slow
def test_trained_torchrun_pp2_gloo_mixed_passes(trained, trained_alone, tmp_path):
    prompts, limits, want = trained_alone
    rows, _ = generate_cli(tmp_path, "pp2-mixed", "pp2", trained, prompts, limits, *mixed(48))
    assert [r["tokens"] for r in rows] == want


@pytest.mark.slow
def test_trained_moe_64_prompts_equal_serving_alone(tmp_path_factory):
    run = shared_checkpoint(tmp_path_factory, "model=tiny_moe")
    prompts, limits = workload()
    want = alone(run, prompts, limits, ["model=tiny_moe"])
    for pipeline in ("single", "pp2"):
        got = engine(run, pipeline, None, ["model=tiny_moe", *mixed(48)]).generate(prompts, limits)
        assert got == want, pipeline
