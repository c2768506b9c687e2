"""Mixed passes through the mixed graph block (graphs=decode_mixed, dsaflow/serve/stage_graphs.py) on CPU: with the
graph manager's forced-eager mode every mixed pass is padded to a token-count class and runs through the static
buffers a captured graph would replay, so the padding is what is tested here (tests/test_serve_mixed_graphs_gpu.py
replays the graphs). Greedy tokens equal unpadded mixed passes and serving each request alone; every mixed pass
arrives at a class; bad block settings fail with the field, the value and the fix."""

from __future__ import annotations

import pytest
from test_serve_mixed import alone, mixed, spy_passes
from test_serve_pipelined import MODEL, SERVE, engine, workload

from dsaflow.config.compose import compose
from dsaflow.errors import PlanError, ServeError
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

GROUP_ROWS = {"single": 8, "pp2": 4}


def graphs(pipeline, classes, extra=()):
    """graphs=decode_mixed with these mixed classes (the largest is the budget), decode classes fitting a group."""
    decode = ",".join(str(c) for c in (1, 2, 4, 8) if c <= GROUP_ROWS[pipeline])
    return [
        "graphs=decode_mixed",
        f"graphs.blocks.0.shape_classes=[{decode}]",
        f"graphs.blocks.1.shape_classes=[{','.join(map(str, classes))}]",
        *mixed(classes[-1]),
        *extra,
    ]


def padded_engine(pipeline, classes, extra=()):
    """An engine whose mixed passes take the graph path, forced eager (CPU: nothing is captured)."""
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, *graphs(pipeline, classes, extra)])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", force_eager=True, all_stages=True)
    report = eng.capture()
    assert {r.kind for r in report.records} == {"decode", "mixed"}
    assert all(r.status == "eager" for r in report.records)  # forced eager: the graph path without a capture
    return eng


@pytest.mark.parametrize("pipeline,classes", [("single", (8, 16, 24)), ("pp2", (10, 20, 40))])
def test_padded_mixed_passes_equal_unpadded_and_serving_alone(pipeline, classes):
    prompts, limits = workload(24, seed=6)
    eng = padded_engine(pipeline, classes)
    seen = spy_passes(eng)
    got = eng.generate(prompts, limits)
    mixed_passes = [p for p in seen if p.token_major]
    assert mixed_passes and all(p.T in classes and p.graph for p in mixed_passes)  # every one arrived at a class
    assert any(-1 in p.positions[0] for p in mixed_passes)  # and some carried padding tokens
    assert any(p.decode_only and p.graph for p in seen)  # decode passes keep their decode graphs
    assert got == engine(None, pipeline, None, mixed(classes[-1])).generate(prompts, limits)  # unpadded, eager
    assert got == alone(None, prompts, limits)


def test_padded_mixed_passes_with_cross_stage_indices():
    """pp2, index.pattern=FSS: stage 1 opens on S layers reading layer 3's padded [1, class, topk] indices."""
    extra = ["index.pattern=FSS", "model.index_topk=8", "pipeline.cross_stage_indices=true"]
    prompts, limits = workload(16, seed=8)
    eng = padded_engine("pp2", (12, 30), extra)
    assert any(s.incoming_source is not None for s in eng.stages.values())
    assert eng.generate(prompts, limits) == alone(None, prompts, limits, extra)


def test_graphs_decode_keeps_mixed_passes_eager():
    cfg = compose(["mode=serve", "pipeline=single", *MODEL, *SERVE, "graphs=decode", *mixed(24)])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", force_eager=True, all_stages=True)
    eng.capture()
    seen = spy_passes(eng)
    eng.generate(*workload(8, seed=3))
    assert not eng.mixed_classes and all(not p.graph for p in seen if p.token_major)
    assert all(p.T <= 24 and -1 not in p.positions[0] for p in seen if p.token_major)  # no padding


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["serve.max_pass_tokens=48"], r"largest mixed class must equal serve.max_pass_tokens=48.*Fix: serve\."),
        (["serve.max_pass_tokens=null"], r"serve.max_pass_tokens=None.*Fix: serve.max_pass_tokens=24 \(mixed"),
    ],
)
def test_bad_mixed_blocks_name_the_fix(overrides, match):
    cfg = compose(["mode=serve", "pipeline=single", *MODEL, *SERVE, *graphs("single", (8, 24)), *overrides])
    with pytest.raises(ServeError, match=match):
        build_engine(cfg, build_plan(cfg), 0, "cpu", force_eager=True, all_stages=True)


def test_mixed_blocks_exist_only_when_serving():
    cfg = compose(["mode=train", *MODEL, "graphs=decode_mixed"])
    with pytest.raises(PlanError, match=r"graphs.blocks\[decode\]: kind=decode exists only when serving"):
        build_plan(cfg)
    cfg.graphs.blocks = cfg.graphs.blocks[1:]
    with pytest.raises(PlanError, match=r"graphs.blocks\[mixed\]: kind=mixed exists only when serving"):
        build_plan(cfg)


def test_timeline_knows_mixed_ticks():
    """The timeline counts a mixed run's ticks by kind (decode or mixed: no prefill-only tick, every prompt chunk
    rides in a mixed pass); its segments tile the run in order and alternate kinds; a run without mixed passes has no
    mixed tick."""
    prompts, limits = workload(16, seed=4)
    eng = engine(None, "pp2", None, mixed(30))
    eng.generate(prompts, limits)
    st = eng.stats
    assert st["tick_kinds"]["mixed"] > 0 and st["tick_kinds"]["decode"] > 0
    assert st["tick_kinds"]["prefill"] == 0  # every prompt chunk rides in a mixed pass
    assert sum(st["tick_kinds"].values()) == st["ticks"]
    segments = st["tick_segments"]
    assert all(a[1] == b[0] and a[2] != b[2] for a, b in zip(segments, segments[1:]))
    assert segments[0][0] >= 0 and segments[-1][1] <= st["wall_s"] + 1e-6
    assert 0 < st["mixed_busy"] <= 1
    plain = engine(None, "pp2", None, ["serve.short_prefill=false"])
    plain.generate(prompts, limits)
    assert plain.stats["tick_kinds"]["mixed"] == 0 and plain.stats["tick_kinds"]["prefill"] > 0
    assert plain.stats["mixed_busy"] == 0.0
