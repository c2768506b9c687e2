"""Serving with cross-stage indices on real devices, CUDA graphs on. Skipped without GPUs; run on the GPU machines with

    .venv/bin/python -m pytest -q -s -m "gpu or multigpu" tests/test_cross_stage_gpu.py

gpu:      stages that open on S (all stages in one process on cuda:0) generate the one-stage greedy tokens with
          decode and prefill graphs captured, every decode step under set_sync_debug_mode("error"); graph replay is
          bit-identical to eager; prints the index bytes each step sends and the time of copying them into the
          receiving stage's static buffer.
multigpu: the same split as a 2-rank NCCL pipeline (`dsaflow generate`, torchrun) equals one stage.
"""

import json

import pytest
import torch
from test_graphs_gpu import (
    BASE,
    STEPS,
    TEXT_PROMPTS,
    assert_bitwise,
    dsaflow_generate,
    prompts,
    run,
)

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine

ONE, SPLIT2, SPLIT4 = "FSSFSSSS", "FSSF|SSSS", "FS|SF|SS|SS"
# one group of rows: the split and the one-stage run then pass the same rows through the same kernels (groups in
# flight are tested in tests/test_serve_pipelined_gpu.py)
CROSS = ["pipeline.cross_stage_indices=true", "serve.microbatches=1"]


def make(layout, prefill_chunk=32):
    cfg = compose(BASE + ["graphs=decode_prefill", f"layout={layout}", *CROSS])
    cfg.serve.prefill_chunk = prefill_chunk
    cfg.graphs.blocks[1].shape_classes = [8, prefill_chunk]
    return cfg, build_plan(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [SPLIT2, SPLIT4])
def test_cross_stage_graphs_generate_the_one_stage_tokens(split):
    ps = prompts(5)
    cfg, plan = make(split)
    assert plan.index_boundaries and not any(l.promoted for l in plan.layers)
    out, eng, report = run(cfg, plan, ps, strict=True)
    assert report.to_dict()["eager"] == 0
    out_eager, eng_eager, _ = run(cfg, plan, ps, force_eager=True)
    assert out == out_eager
    assert_bitwise(eng.logits_log, eng_eager.logits_log)
    ref, eng_ref, _ = run(*make(ONE), ps)
    assert out == ref
    # what the transfers add: bytes per decode step, and the copy into the receiving stage's static buffer
    n, topk = len(ps), cfg.model.index_topk
    sent = len(plan.index_boundaries) * n * topk * 4
    dst = eng.caches[plan.index_boundaries[0] + 1].index[:n, :1]
    src = torch.randint(0, 100, dst.shape, dtype=torch.int32, device=dst.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        dst.copy_(src)
    start.record()
    for _ in range(1000):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    per_copy_us = start.elapsed_time(end)  # ms for 1000 copies = us per copy
    steps = eng.timings["decode_steps"]
    print(
        json.dumps(
            {
                "split": split,
                "device": torch.cuda.get_device_name(0),
                "rows": n,
                "topk": topk,
                "index_bytes_per_decode_step": sent,
                "copy_us_per_boundary_step": round(per_copy_us, 2),
                "decode_ms_per_step": round(1e3 * eng.timings["decode_s"] / steps, 3),
                "decode_ms_per_step_one_stage": round(1e3 * eng_ref.timings["decode_s"] / steps, 3),
            }
        )
    )


@pytest.mark.multigpu
def test_cross_stage_nccl_pipeline_equals_one_stage(tmp_path):
    rows, _ = dsaflow_generate(tmp_path, "graphs=decode_prefill", f"layout={SPLIT2}", *CROSS, prompts_list=TEXT_PROMPTS)
    assert all(len(r["tokens"]) == STEPS + 1 for r in rows)
    cfg = compose(BASE + ["graphs=decode_prefill", f"layout={ONE}"])
    eng = build_engine(cfg, build_plan(cfg), 0, "cuda:0")
    eng.capture()
    assert [r["tokens"] for r in rows] == eng.generate([list(p.encode()) for p in TEXT_PROMPTS])
