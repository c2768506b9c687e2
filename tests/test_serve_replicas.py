"""Serving replicas on CPU (gloo): `dsaflow generate pipeline=pp2 parallel.dp=2` (4 processes, two independent
pp2 pipelines, each serving every other request) writes the same tokens, in input order, as one process running
every stage (which pp2 alone, 2 processes, also writes: tests/test_generate_cli.py sampled, test_serve_pipelined.py
greedy), with continuous and with fixed batches; greedy and sampled (sampling is keyed by the request's input-order
index, not by its place in a replica's share). An odd number of requests splits 8 / 7; a replica with no request
(more replicas than requests) finishes instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.generate import build_engine
from dsaflow.serve.replicas import ReplicaResult, merged, replica_share

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.num_layers=4", "serve.prefill_chunk=4", "serve.max_context=96", "track=none"]
# 15 requests (odd: the shares are 8 and 7) of mixed prompt lengths and per-request limits; byte tokenizer
PROMPTS = [
    ("x" * (1 + (7 * i) % 40) + f" {i}", 2 + (5 * i) % 7)  # lengths 3..43, limits 2..8
    for i in range(15)
]


def dsaflow_generate(tmp_path, name: str, prompts, *args, timeout=300):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": m}) + "\n" for p, m in prompts))
    out = tmp_path / f"{name}-out.jsonl"
    cmd = [sys.executable, "-c", "from dsaflow.cli import main; main()", "generate", *TINY, *args]
    cmd += [f"serve.prompts_file={src}", f"serve.output_file={out}", f"run_dir={tmp_path / name}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p for p, _ in prompts], "rows must come back in input order"
    return rows, res.stdout


def one_process(prompts, *args):
    """Every stage of pipeline=pp2's split in this process (no p2p): the reference tokens."""
    cfg = compose(["mode=serve", "pipeline=pp2", *TINY, *args])
    eng = build_engine(cfg, build_plan(cfg), 0, "cpu", all_stages=True)
    eng.capture()
    return eng.generate([list(p.encode()) for p, _ in prompts], [m for _, m in prompts])


def test_round_robin_shares_cover_every_request_once():
    served = [0, 1, 3, 4, 5, 6, 8]  # 2 and 7 rejected
    shares = [replica_share(served, 3, d) for d in range(3)]
    assert shares == [[0, 4, 8], [1, 5], [3, 6]]
    assert replica_share([0], 2, 1) == []  # more replicas than requests: an empty share
    a = ReplicaResult(0, {0: [1, 2]}, output_tokens=2, wall_s=1.0)
    b = ReplicaResult(1, {1: [3]}, output_tokens=1, wall_s=2.0)
    job = merged([a, b])
    assert job.tokens == {0: [1, 2], 1: [3]} and job.output_tokens == 3 and job.tokens_per_s == 1.5


BATCHING = {
    "continuous greedy": [],
    "fixed greedy": ["serve.batching=fixed"],
    "continuous sampled": ["serve.temperature=0.9", "serve.top_p=0.8", "serve.seed=3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(BATCHING))
def test_pp2_x_dp2_matches_pp2_and_one_process(tmp_path, label):
    extra = BATCHING[label]
    want = one_process(PROMPTS, *extra)
    assert [len(t) for t in want] == [m for _, m in PROMPTS]  # no EOS: every request runs to its own limit
    assert len({tuple(t) for t in want}) > 5, "distinct requests must give distinct tokens (not a vacuous match)"
    dp2, out = dsaflow_generate(tmp_path, "dp2", PROMPTS, "pipeline=pp2", "parallel.dp=2", *extra)
    assert [r["tokens"] for r in dp2] == want
    # the summary: each replica's share and tokens/s, and the total over the slowest replica's wall time
    assert "replica 0 (ranks 0-1): " in out and "for 8 requests" in out
    assert "replica 1 (ranks 2-3): " in out and "for 7 requests" in out
    assert f"all 2 replicas: {sum(m for _, m in PROMPTS)} tokens for 15 requests" in out
    assert all(r["ttft_s"] is not None for r in dp2)
    # every process logged under its own global rank; the plan text names the replicas
    for g in range(4):
        assert (tmp_path / "dp2" / f"serve_rank{g}.log").is_file()
        assert json.loads((tmp_path / "dp2" / f"graphs_rank{g}.json").read_text())["rank"] == g
    assert "replica dp=1: ranks 2-3" in (tmp_path / "dp2" / "plan.txt").read_text()


@pytest.mark.slow
def test_a_replica_without_requests_finishes(tmp_path):
    prompts = PROMPTS[:1]
    rows, out = dsaflow_generate(tmp_path, "one", prompts, "pipeline=pp2", "parallel.dp=2", timeout=120)
    assert [r["tokens"] for r in rows] == one_process(prompts)
    assert "replica 1 (ranks 2-3): 0 tokens for 0 requests" in out
