"""Mixed passes replayed from the mixed graph block (graphs=decode_mixed, serve.max_pass_tokens) on GPUs: greedy
tokens of 64 mixed prompts equal serving each request alone, for pipeline=single / pp2 / pp4 in one process, with
cross-stage indices, for an MoE model and through NCCL ranks (pp2, pp4); every graph is captured once at setup and
only replayed while serving (`graphs.captures` unchanged), every mixed pass replays a captured class, and every
decode and mixed graph pass runs under torch.cuda.set_sync_debug_mode("error") (`strict_sync`). Run:

    .venv/bin/python -m pytest -q -m gpu tests/test_serve_mixed_graphs_gpu.py
    .venv/bin/python -m pytest -q -m multigpu tests/test_serve_mixed_graphs_gpu.py    # 2 GPUs for pp2, 4 for pp4

fp32 serving, as in tests/test_serve_mixed_gpu.py: bf16 rounding of GEMMs over other token counts would flip
near-ties between a mixed pass and a request served alone.
"""

from __future__ import annotations

import pytest
import torch
from test_serve_mixed_gpu import CROSS, MIXED, RANKS, alone
from test_serve_pipelined import MODEL, generate_cli, train_checkpoint, workload

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

SERVE = ["serve.max_batch=8", "serve.max_context=96", "serve.prefill_chunk=16", "serve.dtype=fp32"]
MIXED_CLASSES = (8, 16, 32, 48)  # the largest is MIXED's serve.max_pass_tokens


def decode_classes(pipeline: str) -> str:
    return ",".join(str(c) for c in (1, 2, 4, 8) if c <= 8 // RANKS[pipeline])


def mixed_graphs(pipeline: str) -> list:
    return [
        "graphs=decode_mixed",
        f"graphs.blocks.0.shape_classes=[{decode_classes(pipeline)}]",
        f"graphs.blocks.1.shape_classes=[{','.join(map(str, MIXED_CLASSES))}]",
        *MIXED,
    ]


def engine(run, pipeline, extra=(), model=MODEL):
    """An in-process engine on cuda:0, decode and mixed graphs captured, every decode and mixed graph pass under the
    sync guard."""
    ckpt = [] if run is None else [f"serve.checkpoint={run}"]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *model, *SERVE, *mixed_graphs(pipeline), *ckpt, *extra])
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    report = eng.capture()
    assert {r.kind for r in report.records} == {"decode", "mixed"}
    assert all(r.status == "captured" for r in report.records)
    eng.strict_sync = True
    return eng


def replays_only(eng, prompts, limits):
    """generate, checking that nothing is captured meanwhile and that every mixed pass replays a captured graph of
    its class -> the tokens."""
    captures, runs, inner = eng.graphs.captures, [], eng.graphs.run

    def run(name, stage, n, inputs):
        if eng.graphs.blocks[(name, stage)].kind == "mixed":
            runs.append((name, stage, n))
        return inner(name, stage, n, inputs)

    eng.graphs.run = run
    out = eng.generate(prompts, limits)
    assert eng.graphs.captures == captures  # captured once, at setup: only replays while serving
    assert runs and all(n in MIXED_CLASSES and (name, stage, n) in eng.graphs._graphs for name, stage, n in runs)
    return out


@pytest.fixture(scope="module")
def trained_gpu(tmp_path_factory):
    return train_checkpoint(tmp_path_factory.mktemp("trained_mixed_graphs_gpu") / "run", "train.device=cpu")


@pytest.mark.gpu
def test_mixed_graphs_equal_serving_alone(trained_gpu):
    prompts, limits = workload()
    want = alone(trained_gpu, prompts, limits)
    for pipeline in ("single", "pp2", "pp4"):
        assert replays_only(engine(trained_gpu, pipeline), prompts, limits) == want, pipeline


@pytest.mark.gpu
def test_mixed_graphs_equal_eager_mixed_passes(trained_gpu):
    """The same run with graphs=decode (mixed passes eager, unpadded) gives the same tokens."""
    from test_serve_mixed_gpu import engine as eager_engine

    prompts, limits = workload(seed=3)
    assert replays_only(engine(trained_gpu, "pp2"), prompts, limits) == eager_engine(
        trained_gpu, "pp2", MIXED
    ).generate(prompts, limits)


@pytest.mark.gpu
def test_mixed_graphs_with_cross_stage_indices_equal_serving_alone():
    prompts, limits = workload(seed=2)
    want = alone(None, prompts, limits, CROSS)
    eng = engine(None, "pp2", CROSS)
    assert any(s.incoming_source is not None for s in eng.stages.values())
    assert replays_only(eng, prompts, limits) == want


@pytest.mark.gpu
def test_moe_mixed_graphs_equal_serving_alone(tmp_path_factory):
    moe = ["model=tiny_moe", *MODEL]
    run = train_checkpoint(
        tmp_path_factory.mktemp("moe_mixed_graphs_gpu") / "run", "model=tiny_moe", "train.device=cpu"
    )
    prompts, limits = workload()
    want = alone(run, prompts, limits, model=moe)
    for pipeline in ("single", "pp2"):
        assert replays_only(engine(run, pipeline, model=moe), prompts, limits) == want, pipeline


@pytest.mark.multigpu
@pytest.mark.parametrize("pipeline", ["pp2", "pp4"])
def test_nccl_ranks_with_mixed_graphs_serve_the_tokens_of_each_request_alone(trained_gpu, tmp_path, pipeline):
    if RANKS[pipeline] > torch.cuda.device_count():
        pytest.skip(f"{pipeline} needs {RANKS[pipeline]} GPUs, this machine has {torch.cuda.device_count()}")
    prompts, limits = workload()
    want = alone(trained_gpu, prompts, limits)
    overrides = ["serve.dtype=fp32", *mixed_graphs(pipeline)]
    rows, _ = generate_cli(tmp_path, "run", pipeline, trained_gpu, prompts, limits, *overrides)
    assert [r["tokens"] for r in rows] == want
