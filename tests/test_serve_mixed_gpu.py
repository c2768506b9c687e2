"""Mixed passes (serve.max_pass_tokens) on GPUs, decode graphs on: greedy tokens of 64 mixed prompts equal serving
each request alone, for pipeline=single / pp2 / pp4 in one process, through NCCL ranks (pp2, pp4), with cross-stage
indices and for an MoE model; the token-major indexer kernel equals the naive op at DeepSeek-V3.2 shapes. Run:

    .venv/bin/python -m pytest -q -m gpu tests/test_serve_mixed_gpu.py
    .venv/bin/python -m pytest -q -m multigpu tests/test_serve_mixed_gpu.py    # 2 GPUs for pp2, 4 for pp4

fp32 serving, as in tests/test_serve_pipelined_gpu.py: bf16 rounding of GEMMs over other row counts would flip
near-ties between a mixed pass and a request served alone.
"""

from __future__ import annotations

import pytest
import torch
from test_indexer_fp8 import assert_selection_within
from test_serve_pipelined import MODEL, generate_cli, train_checkpoint, workload

from dsaflow.config.compose import compose
from dsaflow.ops.indexer_topk import indexer_topk_naive
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

SERVE = ["serve.max_batch=8", "serve.max_context=96", "serve.prefill_chunk=16", "serve.dtype=fp32"]
MIXED = ["serve.max_pass_tokens=48", "serve.short_prefill=false", "serve.batching=continuous"]
CROSS = ["index.pattern=FSS", "model.index_topk=8", "pipeline.cross_stage_indices=true"]
RANKS = {"single": 1, "pp2": 2, "pp4": 4}


def engine(run, pipeline, extra=(), model=MODEL, rows=8):
    """An in-process engine on cuda:0, decode graphs captured (mixed passes run eagerly), every decode pass under
    the sync guard."""
    ckpt = [] if run is None else [f"serve.checkpoint={run}"]
    cfg = compose(["mode=serve", f"pipeline={pipeline}", *model, *SERVE, "graphs=decode", *ckpt, *extra])
    cfg.serve.max_batch = rows
    group = rows // (1 if rows == 1 else RANKS[pipeline])
    cfg.graphs.blocks[0].shape_classes = [c for c in (1, 2, 4, 8) if c <= group]
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0", all_stages=True)
    report = eng.capture()
    assert report.records and all(r.status == "captured" for r in report.records)
    eng.strict_sync = True
    return eng


def alone(run, prompts, limits, extra=(), model=MODEL):
    eng = engine(run, "single", ["serve.short_prefill=false", *extra], model, rows=1)
    return [eng.generate([p], [m])[0] for p, m in zip(prompts, limits)]


@pytest.fixture(scope="module")
def trained_gpu(tmp_path_factory):
    return train_checkpoint(tmp_path_factory.mktemp("trained_mixed_gpu") / "run", "train.device=cpu")


@pytest.mark.gpu
def test_mixed_passes_with_decode_graphs_equal_serving_alone(trained_gpu):
    prompts, limits = workload()
    want = alone(trained_gpu, prompts, limits)
    for pipeline in ("single", "pp2", "pp4"):
        eng = engine(trained_gpu, pipeline, MIXED)
        captures = eng.graphs.captures
        assert eng.generate(prompts, limits) == want, pipeline
        assert eng.graphs.captures == captures  # decode passes replayed their graphs


@pytest.mark.gpu
def test_mixed_passes_with_cross_stage_indices_equal_serving_alone():
    prompts, limits = workload(seed=2)
    want = alone(None, prompts, limits, CROSS)
    eng = engine(None, "pp2", [*CROSS, *MIXED])
    assert any(s.incoming_source is not None for s in eng.stages.values())
    assert eng.generate(prompts, limits) == want


@pytest.mark.gpu
def test_moe_mixed_passes_equal_serving_alone(tmp_path_factory):
    moe = ["model=tiny_moe", *MODEL]
    run = train_checkpoint(tmp_path_factory.mktemp("moe_mixed_gpu") / "run", "model=tiny_moe", "train.device=cpu")
    prompts, limits = workload()
    want = alone(run, prompts, limits, model=moe)
    for pipeline in ("single", "pp2"):
        assert engine(run, pipeline, MIXED, model=moe).generate(prompts, limits) == want, pipeline


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_token_major_indexer_kernel_equals_naive_v32_shapes(fp8):
    """64 index heads x 128, topk 2048, 4 rows of 8192 keys, 300 queries of mixed rows (bf16 in): the key-rows kernel
    selects what the naive op selects from the same rounded inputs (fp8: every pick at or above the reference's cut
    on its own row's keys, within the fp8 MMA's summation error, as tests/test_indexer_fp8.py holds the fp8 op)."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    from dsaflow.ops.indexer_topk.triton_indexer import indexer_topk_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    R, N, H, D, S = 4, 300, 64, 128, 8192
    q = torch.randn(1, N, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(R, S, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, N, H, device="cuda", generator=g).bfloat16()
    rows = torch.randint(0, R, (1, N), device="cuda", generator=g)
    pos = torch.randint(-1, S, (1, N), device="cuda", generator=g)
    got = indexer_topk_triton(q, k, w, pos, 2048, fp8=fp8, key_rows=rows)
    if fp8:  # the fp8 MMA sums otherwise than the reference: ties at the cut are many, so hold the picks to the cut
        for r in range(R):
            mine = rows[0] == r
            assert_selection_within(got[:, mine], q[:, mine], k[r : r + 1], w[:, mine], pos[:, mine], 2048)
        return
    want = indexer_topk_naive(q, k, w, pos, 2048, fp8=fp8, key_rows=rows)
    same = (got.sort(-1).values == want.sort(-1).values).float().mean()
    assert same > 0.999  # fp32 sums in another order may swap a near-tie at the cut, nothing more


@pytest.mark.multigpu
@pytest.mark.parametrize("pipeline", ["pp2", "pp4"])
def test_nccl_ranks_with_mixed_passes_serve_the_tokens_of_each_request_alone(trained_gpu, tmp_path, pipeline):
    if RANKS[pipeline] > torch.cuda.device_count():
        pytest.skip(f"{pipeline} needs {RANKS[pipeline]} GPUs, this machine has {torch.cuda.device_count()}")
    prompts, limits = workload()
    want = alone(trained_gpu, prompts, limits)
    decode_classes = ",".join(str(c) for c in (1, 2, 4, 8) if c <= 8 // RANKS[pipeline])
    rows, _ = generate_cli(
        tmp_path,
        "run",
        pipeline,
        trained_gpu,
        prompts,
        limits,
        "serve.dtype=fp32",
        "graphs=decode",
        f"graphs.blocks.0.shape_classes=[{decode_classes}]",
        *MIXED,
    )
    assert [r["tokens"] for r in rows] == want
