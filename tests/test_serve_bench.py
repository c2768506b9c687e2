"""`scripts/bench_serve.py engine` end to end on CPU at tiny size: one process for `single`, torchrun + gloo for `pp2`; the
JSON rows carry the fields the docs promise, the comparisons are computed from them, the table and the PNG exist."""

import argparse
import gzip
import json
from pathlib import Path

import pytest
import torch
from script_helpers import load_script


@pytest.mark.slow
def test_bench_serve_cpu_single_and_pp2(tmp_path):
    bench = load_script("bench_serve")
    argv = [
        "engine",
        "--device",
        "cpu",
        "--pipelines",
        "single,pp2",
        "--requests",
        "6",
        "--max-batch",
        "4",
        "--prefill-chunk",
        "8",
        "--mixed-prompt",
        "4,24",
        "--mixed-new",
        "2,6",
        "--uniform-prompt",
        "8",
        "--uniform-new",
        "4",
        "--overrides",
        "none",
        "--out",
        str(tmp_path),
    ]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    rows = data["rows"]
    got = {(r["pipeline"], r["microbatches"], r["workload"], r["batching"]) for r in rows}
    assert got == {
        ("single", 1, "mixed", "continuous"),
        ("single", 1, "uniform", "continuous"),
        ("single", 1, "mixed", "fixed"),
        ("pp2", 1, "mixed", "continuous"),
        ("pp2", 2, "mixed", "continuous"),
        ("pp2", 1, "uniform", "continuous"),
        ("pp2", 2, "uniform", "continuous"),
        ("pp2", 2, "mixed", "fixed"),
    }
    for r in rows:
        assert len(r["busy_fraction"]) == len(r["decode_busy_fraction"]) == r["ranks"]
        assert all(0 < b <= 1.0 + 1e-9 for b in r["busy_fraction"])
        assert r["tokens_per_s"] > 0
        assert abs(r["tokens_per_s"] - r["output_tokens"] / r["wall_s"]) < 1e-6 * r["tokens_per_s"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
        assert (
            r["graphs_captured"] == [0] * r["ranks"] and len(r["capture_s"]) == len(r["graph_pool_gib"]) == r["ranks"]
        )
        assert r["transfer_graphs"] == [None] * r["ranks"]  # graphs.transfers is off (and CUDA only)
        after = r["busy_after_prefill"]  # per rank: the K-1 ticks after a prefill pass (none with one rank)
        assert len(after) == r["ranks"] and all(len(a) == r["ranks"] - 1 for a in after)
        assert all(f is None or 0 <= f <= 1.0 + 1e-9 for a in after for f in a)
        want = 6 * 4 if r["workload"] == "uniform" else None
        assert want is None or r["output_tokens"] == want
    mixed = {r["output_tokens"] for r in rows if r["workload"] == "mixed"}
    assert len(mixed) == 1  # every configuration served the same requests to their own limits
    checks = {c["check"] for c in data["checks"]}
    assert {
        "pp2 mixed: default groups vs serve.microbatches=1",
        "pp2 uniform: default groups vs serve.microbatches=1",
        "pp2 mixed: continuous vs fixed batches",
        "single mixed: continuous vs fixed batches",
    } == checks
    md = (tmp_path / "bench_serve.md").read_text()
    assert md.count("\n| pp2 |") == 5 and "default groups vs serve.microbatches=1" in md
    assert (tmp_path / "bench_serve.png").stat().st_size > 1000
    assert not (tmp_path / "bench_serve.partial.jsonl").exists()  # the full results replace it
    assert data["env"]["overrides"] == "" and len(data["env"]["load_average_1min"]) == 2
    assert not list(tmp_path.glob("trace-*")), "no traces without --trace"


@pytest.mark.slow
def test_bench_serve_trace_writes_one_chrome_trace_per_rank_of_every_row(tmp_path):
    """--trace, in this process (single) and on every torchrun rank (pp2): one Chrome trace per rank of every row,
    holding the engine's stage calls. The uniform workload alone: a trace costs seconds to write on CPU, and the
    rows' own fields are checked without it above."""
    bench = load_script("bench_serve")
    argv = ["engine", "--device", "cpu", "--pipelines", "single,pp2", "--workloads", "uniform", "--requests", "6"]
    argv += ["--max-batch", "4", "--prefill-chunk", "8", "--uniform-prompt", "8", "--uniform-new", "4"]
    argv += ["--overrides", "none", "--out", str(tmp_path), "--trace"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "bench_serve.json").read_text())["rows"]
    assert {(r["pipeline"], r["microbatches"]) for r in rows} == {("single", 1), ("pp2", 1), ("pp2", 2)}
    traces = sorted(p.name for p in tmp_path.glob("trace-*.json.gz"))
    assert len(traces) == sum(r["ranks"] for r in rows)
    assert "trace-single-g1-uniform-continuous-rank0.json.gz" in traces
    assert "trace-pp2-g2-uniform-continuous-rank1.json.gz" in traces
    for name in (traces[0], traces[-1]):  # a pp2 rank's and the single process's
        events = json.loads(gzip.decompress((tmp_path / name).read_bytes()))["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)


@pytest.mark.slow
def test_bench_serve_replicas_report_tokens_per_s_per_replica_and_in_all(tmp_path):
    """pp2x2: two pp2 replicas (4 processes) serve 5 requests 3 / 2; the row counts every replica's tokens, gives
    each replica's tokens/s, and a check compares it with pp2's row."""
    bench = load_script("bench_serve")
    argv = ["engine", "--device", "cpu", "--pipelines", "pp2,pp2x2", "--workloads", "uniform", "--requests", "5"]
    argv += ["--max-batch", "2", "--prefill-chunk", "8", "--uniform-prompt", "6", "--uniform-new", "3"]
    argv += ["--overrides", "none", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    rows = {(r["pipeline"], r["microbatches_setting"]): r for r in data["rows"]}
    for mb in (1, "default"):
        r = rows[("pp2x2", mb)]
        assert r["replicas"] == 2 and r["ranks"] == 2 and r["output_tokens"] == 5 * 3
        assert len(r["replica_tokens_per_s"]) == 2 and len(r["busy_fraction"]) == 4
        assert r["tokens_per_s"] <= sum(r["replica_tokens_per_s"]) + 1e-9  # all tokens over the slowest wall
        assert rows[("pp2", mb)]["replicas"] == 1
    checks = {c["check"] for c in data["checks"]}
    assert "pp2x2 uniform continuous serve.microbatches=1: 2 replicas vs one" in checks
    assert "per replica)" in (tmp_path / "bench_serve.md").read_text()


def test_replicas_need_a_request_each(capsys):
    bench = load_script("benches.serve_engine")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--pipelines", "pp2x4", "--requests", "3"])
    assert exc.value.code == 2 and "Fix: --requests 4" in capsys.readouterr().err


def test_bench_serve_mixed_pass_rows_carry_the_budget_and_the_comparisons(tmp_path):
    """--max-pass-tokens adds a continuous row with mixed passes per budget, compared with today's continuous and
    fixed batches (tokens/s, TTFT p99), its budget a column of the table."""
    bench = load_script("bench_serve")
    argv = ["engine", "--device", "cpu", "--pipelines", "pp2", "--workloads", "mixed", "--requests", "6"]
    argv += ["--max-batch", "4", "--prefill-chunk", "8", "--mixed-prompt", "4,24", "--mixed-new", "2,6"]
    argv += ["--overrides", "none", "--max-pass-tokens", "6,12", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    mixed = [r for r in data["rows"] if r["max_pass_tokens"]]
    assert [r["max_pass_tokens"] for r in mixed] == [6, 12]
    assert all(r["batching"] == "continuous" and 0 < r["mixed_pass_share"] < 1 for r in mixed)
    assert len({r["output_tokens"] for r in data["rows"]}) == 1  # the same requests to their own limits
    cks = [c for c in data["checks"] if c.get("max_pass_tokens")]
    assert [c["max_pass_tokens"] for c in cks] == [6, 12]
    assert all(c["tokens_per_s_vs_fixed"] > 0 and c["ttft_p99_ratio"] > 0 for c in cks)
    md = (tmp_path / "bench_serve.md").read_text()
    assert "| mixed | continuous | 12 | off |" in md and "mixed passes (budget 6) vs today's continuous and fixed" in md
    # the timeline's tick kinds: mixed rows have mixed ticks, drawn as segments that tile the run
    assert all(r["mixed_graphs"] == "off" and r["tick_kinds"]["mixed"] > 0 for r in mixed)
    assert all(r["tick_kinds"]["mixed"] == 0 for r in data["rows"] if not r["max_pass_tokens"])
    assert all(len(r["mixed_busy_fraction"]) == 2 and r["tick_segments"] for r in mixed)
    assert any(s[2] == "mixed" for s in mixed[0]["tick_segments"])
    assert (tmp_path / "bench_serve.png").stat().st_size > 0


def test_mixed_graphs_rows_one_per_budget_and_setting(capsys):
    """--mixed-graphs on,off runs each budget's row twice (graphs, eager), `mixed_graphs` naming which; on CPU, or
    without budgets, --mixed-graphs on exits 2 naming the fix; the graphs' classes end at the budget."""
    bench, setup = load_script("benches.serve_engine"), load_script("benches.serve_setup")
    args = argparse.Namespace(workloads="mixed", max_pass_tokens="96,1024", mixed_graphs="on,off")
    runs = [r for r in setup.runs_of(args, "pp2") if r[3]]
    assert [(r[3], r[4]) for r in runs] == [(96, "on"), (96, "off"), (1024, "on"), (1024, "off")]
    assert setup.mixed_classes(96) == [64, 96] and setup.mixed_classes(1024) == [64, 128, 256, 512, 1024]
    for argv in (["--max-pass-tokens", "64", "--mixed-graphs", "on,off"], ["--mixed-graphs", "on"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--device", "cpu", *argv])
        assert e.value.code == 2 and "Fix: --device cuda --graphs on --max-pass-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cpu", "--mixed-graphs", "of"])
    assert e.value.code == 2 and "Fix: --mixed-graphs on,off" in capsys.readouterr().err


def test_coarse_segments_keep_few_and_bin_many():
    report = load_script("benches.serve_report")
    few = [(0.0, 1.0, "mixed"), (1.0, 3.0, "decode")]
    assert report.coarse_segments(few) == [[0.0, 1.0, "mixed"], [1.0, 3.0, "decode"]]
    many = [(i * 0.1, (i + 1) * 0.1, "mixed" if i % 10 < 7 else "decode") for i in range(1000)]
    coarse = report.coarse_segments(many, bins=10)
    assert coarse == [[0.0, coarse[-1][1], "mixed"]] and coarse[-1][1] == pytest.approx(100.0)  # mostly mixed bins


def test_an_interrupted_run_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """A run stopped after `single` (here pp2's launch fails) leaves single's rows in bench_serve.partial.jsonl, one
    JSON object a line, and writes no bench_serve.json; a rerun starts the partial file afresh."""
    bench = load_script("benches.serve_engine")
    argv = ["--device", "cpu", "--pipelines", "single,pp2", "--workloads", "uniform", "--requests", "3"]
    argv += ["--max-batch", "2", "--prefill-chunk", "8", "--uniform-prompt", "6", "--uniform-new", "3"]
    argv += ["--overrides", "none", "--out", str(tmp_path)]
    (tmp_path / "bench_serve.partial.jsonl").write_text('{"stale": true}\n')

    def launch_fails(args, pipeline):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_pipeline", launch_fails)
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    rows = [json.loads(line) for line in (tmp_path / "bench_serve.partial.jsonl").read_text().splitlines()]
    assert [(r["pipeline"], r["workload"], r["output_tokens"]) for r in rows] == [("single", "uniform", 9)]
    assert rows[0]["tokens_per_s"] > 0 and not (tmp_path / "bench_serve.json").exists()


def test_profile_passes_needs_cuda(capsys):
    """--profile-passes times one process's passes with CUDA events: on CPU or with a pp split it exits 2 naming the
    flag and the fix."""
    bench = load_script("benches.serve_engine")
    for argv in (["--device", "cpu"], ["--device", "cuda", "--pipelines", "single,pp2"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args([*argv, "--profile-passes"])
        assert (
            e.value.code == 2
            and "--profile-passes needs --device cuda and --pipelines single" in capsys.readouterr().err
        )


@pytest.mark.parametrize("rank", [0, 1])
def test_bench_serve_rank_runs_one_pp2_rank_alone_through_every_request(tmp_path, rank):
    """`scripts/bench_serve.py rank`: a pp2 rank with its partner replaced by the loopback link serves every request
    to its limit (the schedule of the real run) and reports its own busy fraction."""
    tool = load_script("bench_serve")
    argv = ["rank", "--device", "cpu", "--pipeline", "pp2", "--rank", str(rank), "--workloads", "uniform"]
    argv += ["--requests", "6", "--max-batch", "4", "--prefill-chunk", "8", "--uniform-prompt", "8"]
    argv += ["--uniform-new", "4", "--overrides", "none", "--out", str(tmp_path)]
    assert tool.main(argv) == 0
    data = json.loads((tmp_path / "bench_serve_rank.json").read_text())
    assert "--rank" in data["command"]
    rows = data["rows"]
    assert [r["microbatches"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rank_alone"] == rank and r["output_tokens"] == 6 * 4
        assert len(r["busy_fraction"]) == 1 and 0 < r["busy_fraction"][0] <= 1.0 + 1e-9
    assert (tmp_path / "bench_serve_rank.md").read_text().count("| uniform |") == 2


def test_loopback_link_fills_activations_with_values_and_integers_with_zeros():
    link = load_script("benches.serve_rank").LoopbackLink(torch.device("cpu"), seed=3)
    hidden, again = torch.full((2, 1, 8), float("nan")), torch.full((2, 1, 8), float("nan"))
    tokens, sent = torch.full((2, 4), 7, dtype=torch.long), torch.ones(3)
    link.exchange([("recv", hidden, 0), ("recv", tokens, 1), ("send", sent, 1)])
    link.exchange([("recv", again, 0)])
    assert torch.isfinite(hidden).all() and hidden.std() > 0.3  # not zeros: real-looking indexer scores
    assert torch.equal(hidden, again) and tokens.eq(0).all() and sent.eq(1).all()
    bigger = torch.empty(3, 1, 8)
    link.exchange([("recv", bigger, 0)])
    link.exchange([("recv", again, 0)])  # a larger size draws new values; smaller receives copy their prefix
    assert torch.isfinite(bigger).all() and torch.equal(bigger.view(-1)[:16], again.view(-1))


def test_bench_p2p_needs_two_gpus_and_says_so(tmp_path):
    """Without two GPUs the transfer benchmark exits 2 with one line, before launching any rank."""
    import subprocess
    import sys

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs: the benchmark would run")
    r = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"),
            "p2p",
            "--out",
            "unused",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("bench_serve.py p2p: needs 2 CUDA GPUs"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "unused").exists()
