"""Pipelined serving on one GPU with CUDA graphs on: greedy tokens of a trained model are identical across
pipeline=single / pp2 / pp4 (every stage in this process, each group with its own graphs) and across
serve.microbatches=1 / the default. Run on a GPU machine:

    .venv/bin/python -m pytest -q -m gpu tests/test_serve_pipelined_gpu.py

fp32 serving: the groups change the row count of every GEMM, and bf16 rounding would then flip near-ties.
"""

import pytest
from test_serve_pipelined import MODEL, PIPELINES, eos_cut, train_checkpoint, workload

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

SERVE = [
    "serve.max_batch=8",
    "serve.max_context=96",
    "serve.prefill_chunk=16",
    "serve.dtype=fp32",
    "graphs=decode_prefill",
]


@pytest.fixture(scope="module")
def trained_gpu(tmp_path_factory):
    return train_checkpoint(tmp_path_factory.mktemp("trained_gpu") / "run")


def gpu_engine(run, pipeline, microbatches, extra=()):
    mb = [] if microbatches is None else [f"serve.microbatches={microbatches}"]
    batching = [] if any(e.startswith("serve.batching=") for e in extra) else ["serve.batching=fixed"]
    cfg = compose(
        ["mode=serve", f"pipeline={pipeline}", *MODEL, *SERVE, f"serve.checkpoint={run}", *mb, *batching, *extra]
    )
    groups = microbatches or {"single": 1, "pp2": 2, "pp4": 4}[pipeline]
    rows = 8 // groups
    cfg.graphs.blocks[0].shape_classes = [c for c in (1, 2, 4, 8) if c <= rows]
    cfg.graphs.blocks[1].shape_classes = [8, 16]
    plan = build_plan(cfg)
    eng = build_engine(cfg, plan, 0, "cuda:0", all_stages=True)
    report = eng.capture()
    assert report.records and all(r.status == "captured" for r in report.records)
    eng.strict_sync = True  # every decode pass under set_sync_debug_mode("error")
    return eng


@pytest.mark.gpu
def test_greedy_tokens_identical_across_pipelines_and_groups_with_graphs(trained_gpu):
    prompts, limits = workload()
    ref = gpu_engine(trained_gpu, "single", 1).generate(prompts, limits)
    assert [len(o) for o in ref] == limits and len({tuple(o) for o in ref}) > 32
    for pipeline in PIPELINES:
        for mb in (1, None):
            eng = gpu_engine(trained_gpu, pipeline, mb)
            captures = eng.graphs.captures
            assert eng.generate(prompts, limits) == ref, (pipeline, mb)
            assert eng.graphs.captures == captures  # replays only


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["single", "pp2"])
def test_continuous_batching_with_top_row_prefill_graphs_serves_the_same_tokens(trained_gpu, pipeline):
    """serve.batching=continuous with prefill graphs: refills move rows on the GPU caches and joiners prefill through
    graphs over the group's top rows; every token equals the fixed-batch run's."""
    prompts, limits = workload()
    ref = gpu_engine(trained_gpu, "single", 1).generate(prompts, limits)
    eng = gpu_engine(trained_gpu, pipeline, None, ["serve.batching=continuous"])
    assert len(eng.row_classes) > 1
    captures = eng.graphs.captures
    assert eng.generate(prompts, limits) == ref
    assert eng.graphs.captures == captures


@pytest.mark.gpu
def test_eos_read_one_pass_late_keeps_the_tokens_with_graphs(trained_gpu):
    """serve.eos_id on the GPU: the flags go to pinned memory and are read one pass of the group late
    (dsaflow/serve/eos.py), with every decode pass under the sync guard; each request's output is its greedy
    tokens up to and with its first EOS."""
    prompts, limits = workload()
    ref = gpu_engine(trained_gpu, "single", 1).generate(prompts, limits)
    eos, cut = eos_cut(ref, 16)
    for pipeline in ("single", "pp2"):
        eng = gpu_engine(trained_gpu, pipeline, None, ["serve.batching=continuous", f"serve.eos_id={eos}"])
        assert eng.generate(prompts, limits) == cut, pipeline
        assert eng.late_eos.cuda and eng.late_eos.host  # the flags went through the pinned buffers
        assert eng.stats["tokens"] == sum(map(len, cut))
