"""GPU training through the real launch path (NCCL, one process per GPU). Skipped without CUDA devices:
`python -m pytest -q tests/test_train_gpu.py` on a machine with one (gpu) or two (multigpu) GPUs."""

from __future__ import annotations

import json
import math

import pytest

from dsaflow import cli

SMALL = [
    "model.num_layers=4",
    "model.dim=64",
    "train.seq_len=128",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.progress=lines",
    "track=none",
    "train.device=cuda",
    "train.final_ckpt=false",
]


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _losses(run):
    return [r["loss"] for r in _records(run)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@pytest.mark.gpu
def test_cpu_and_cuda_log_the_same_metrics_in_fp32(tmp_path, monkeypatch):
    """The main job (model=tiny, retrieval) for a few steps on CPU and on CUDA, fp32 everywhere: every logged number
    is what it names and agrees across devices. Step 1 runs before any update, so only summation order differs
    (fp32 dots are IEEE on the GPU); later steps may drift by Adam's amplification of those differences."""
    monkeypatch.chdir(tmp_path)
    common = [
        "train.steps=3",
        "train.dtype=fp32",
        "train.eval_every=0",
        "train.eval_batches=1",
        "track=none",
        "train.final_ckpt=false",
        "train.progress=lines",
        "train.warmup_steps=1",
    ]
    assert cli.main(["train", *common, "train.device=cpu", f"run_dir={tmp_path / 'cpu'}"]) == 0
    assert cli.main(["train", *common, "train.device=cuda", f"run_dir={tmp_path / 'cuda'}"]) == 0
    cpu, gpu = _records(tmp_path / "cpu"), _records(tmp_path / "cuda")
    assert len(cpu) == len(gpu) == 3
    for step, (c, g) in enumerate(zip(cpu, gpu), start=1):
        tol = 1e-5 if step == 1 else 1e-3
        for key in ("loss", "grad_norm", "indexer_grad_norm"):
            bound = 10 * tol if "norm" in key else tol  # a norm sums many squared differences
            assert _rel(c[key], g[key]) <= bound, (step, key, c[key], g[key])
        # The KL is a small difference of two sums of size ~log K (sum t log t - sum t log q per query): fp32
        # rounding bounds their difference absolutely, by about sqrt(K) * log(K) * 2^-24 per term (x4 margin).
        k = 16  # model=tiny's index_topk
        kl_atol = 4 * math.sqrt(k) * math.log(k) * 2.0**-24
        assert abs(c["indexer_loss"] - g["indexer_loss"]) <= kl_atol + 10 * tol * abs(c["indexer_loss"]), (
            step,
            c["indexer_loss"],
            g["indexer_loss"],
        )
        assert c["indexer_loss"] < 1.0 and g["indexer_loss"] < 1.0, "the indexer loss must not carry memory GiB"


@pytest.mark.gpu
def test_one_gpu_trains_bf16(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *SMALL, "train.steps=4", f"run_dir={tmp_path / 'r'}"]) == 0
    losses = _losses(tmp_path / "r")
    assert len(losses) == 4 and all(math.isfinite(l) for l in losses)


@pytest.mark.multigpu
@pytest.mark.parametrize("pipeline", ["pp2", "pp2_interleaved"])
def test_two_gpus_match_one_gpu_in_fp32(tmp_path, monkeypatch, pipeline):
    """train.deterministic=true, fp32: two PP=1 runs are bit-identical (the run-to-run spread is zero), and PP=2 over
    NCCL gives the PP=1 losses up to the one order that the split changes: the global gradient norm is a sum over
    ranks (an fp32 reordering, ~1e-7 relative, seen through gradient clipping)."""
    monkeypatch.chdir(tmp_path)
    common = [
        *SMALL,
        "train.dtype=fp32",
        "train.deterministic=true",
        "train.steps=3",
        "pipeline.microbatches=4",
        "train.eval_every=0",
    ]
    for name in ("pp1_a", "pp1_b"):
        assert cli.main(["train", *common, f"run_dir={tmp_path / name}"]) == 0
    assert (
        cli.main(["train", *common, f"pipeline={pipeline}", "pipeline.microbatches=4", f"run_dir={tmp_path / 'pp2'}"])
        == 0
    )
    a, b, pp2 = (_losses(tmp_path / n) for n in ("pp1_a", "pp1_b", "pp2"))
    assert a == b, f"deterministic PP=1 runs differ: {a} vs {b}"
    for x, y in zip(a, pp2):
        assert _rel(x, y) <= 1e-6, f"PP=2 {pp2} vs PP=1 {a}"
