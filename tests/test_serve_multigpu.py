"""Pipelined serving through real ranks, one GPU and one NCCL process each, CUDA graphs on: `dsaflow generate
pipeline=pp2 / pp4` serves a trained model's greedy tokens identical, token for token, to one stage in one process,
with one group (serve.microbatches=1) and with the default groups (one per rank), continuous batching. Run on a
machine with 2 or more GPUs (pp4 needs 4):

    .venv/bin/python -m pytest -q -m multigpu tests/test_serve_multigpu.py

fp32 serving, as in tests/test_serve_pipelined_gpu.py: the groups change the row count of every GEMM, and bf16
rounding would flip near-ties. The model is trained on the CPU, so the GPUs compile only the serving kernels.
"""

import json
import shutil

import pytest
import torch
from test_serve_pipelined import MODEL, generate_cli, train_checkpoint, workload
from test_serve_pipelined_gpu import gpu_engine

from dsaflow.checkpoint.weights import check_same_model, resolve_checkpoint
from dsaflow.config.compose import compose
from dsaflow.errors import ServeError

RANKS = {"pp2": 2, "pp4": 4}


@pytest.fixture(scope="module")
def trained_on_cpu(request):
    """A run dir of the tiny model trained on the CPU, kept in pytest's cache (.pytest_cache): a later run, say pp4 on
    all GPUs after pp2 on two of them, serves the same weights without training again."""
    keep = request.config.cache.mkdir("serve_multigpu_trained")
    run, done = keep / "run", keep / "trained"
    if not (done.exists() and trained_as_now(run)):
        done.unlink(missing_ok=True)
        shutil.rmtree(run, ignore_errors=True)
        train_checkpoint(run, "train.device=cpu")
        done.touch()  # only a finished training is reused
    return run


def trained_as_now(run) -> bool:
    """Whether a kept run holds a good checkpoint of the model these tests compose today (not one from before a
    change of the tiny model's defaults)."""
    try:
        check_same_model(compose(["mode=serve", *MODEL]).model, resolve_checkpoint(run, report=lambda msg: None))
    except ServeError:
        return False
    return True


@pytest.fixture(scope="module")
def greedy_reference(trained_on_cpu):
    """(prompts, limits, tokens): 64 mixed-length prompts served by one stage in this process, graphs on."""
    prompts, limits = workload()
    ref = gpu_engine(trained_on_cpu, "single", 1).generate(prompts, limits)
    assert [len(o) for o in ref] == limits and len({tuple(o) for o in ref}) > 32
    return prompts, limits, ref


@pytest.mark.multigpu
@pytest.mark.parametrize("pipeline", ["pp2", "pp4"])
@pytest.mark.parametrize("microbatches,transfers", [(1, False), (None, False), (None, True)])
def test_nccl_ranks_serve_the_greedy_tokens_of_one_stage(
    trained_on_cpu, greedy_reference, tmp_path, pipeline, microbatches, transfers
):
    """transfers: graphs.transfers=true, each decode tick's NCCL transfers replayed from CUDA graphs."""
    if RANKS[pipeline] > torch.cuda.device_count():
        pytest.skip(f"{pipeline} needs {RANKS[pipeline]} GPUs, this machine has {torch.cuda.device_count()}")
    prompts, limits, ref = greedy_reference
    groups = microbatches or RANKS[pipeline]
    decode_classes = ",".join(str(c) for c in (1, 2, 4, 8) if c <= 8 // groups)  # at most a group's rows
    rows, _ = generate_cli(
        tmp_path,
        "run",
        pipeline,
        trained_on_cpu,
        prompts,
        limits,
        "serve.dtype=fp32",
        "graphs=decode_prefill",
        f"graphs.blocks.0.shape_classes=[{decode_classes}]",
        "graphs.blocks.1.shape_classes=[8,16]",
        *([] if microbatches is None else [f"serve.microbatches={microbatches}"]),
        *(["graphs.transfers=true"] if transfers else []),
    )
    assert [r["num_tokens"] for r in rows] == limits
    assert [r["tokens"] for r in rows] == ref, (pipeline, microbatches)
    for r in range(RANKS[pipeline]):  # every rank captured its own graphs on its own GPU, none fell back to eager
        rep = json.loads((tmp_path / "run" / f"graphs_rank{r}.json").read_text())
        assert rep["eager"] == 0 and rep["captured"] > 0
        assert {x["device"] for x in rep["records"]} == {f"cuda:{r}"}
        log = (tmp_path / "run" / f"serve_rank{r}.log").read_text()
        if transfers:  # the decode ticks replayed their transfers, from few captures
            line = log.split("transfer graphs: ")[1]
            captured, replays = int(line.split()[0]), int(line.split(", ")[1].split()[0])
            assert 0 < captured < replays
        else:
            assert "transfer graphs" not in log


@pytest.mark.multigpu
@pytest.mark.parametrize("transfers", [False, True])
def test_two_pp2_replicas_serve_the_greedy_tokens_of_one_stage(trained_on_cpu, greedy_reference, tmp_path, transfers):
    """pipeline=pp2 parallel.dp=2 on 4 GPUs: two NCCL pipelines (global ranks 0-1 and 2-3, graphs captured on each
    rank's own GPU) serve every other request; the merged output is one stage's greedy tokens in input order."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"pp2 x dp2 needs 4 GPUs, this machine has {torch.cuda.device_count()}")
    prompts, limits, ref = greedy_reference
    rows, res = generate_cli(
        tmp_path,
        "run",
        "pp2",
        trained_on_cpu,
        prompts,
        limits,
        "parallel.dp=2",
        "serve.dtype=fp32",
        "graphs=decode_prefill",
        "graphs.blocks.0.shape_classes=[1,2,4]",
        "graphs.blocks.1.shape_classes=[8,16]",
        *(["graphs.transfers=true"] if transfers else []),
    )
    assert [r["tokens"] for r in rows] == ref
    for g in range(4):
        rep = json.loads((tmp_path / "run" / f"graphs_rank{g}.json").read_text())
        assert rep["eager"] == 0 and rep["captured"] > 0
        assert {x["device"] for x in rep["records"]} == {f"cuda:{g}"}
    assert "replica 1 (ranks 2-3): " in res.stdout and "all 2 replicas: " in res.stdout
