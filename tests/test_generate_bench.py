"""`scripts/bench_serve.py decode` runs end to end on CPU at tiny size (eager only; graphs need CUDA): in-process for one
stage and through torchrun + gloo for two, writing consistent JSON and markdown."""

import json

import pytest
from script_helpers import load_script


@pytest.mark.slow
def test_bench_decode_cpu_one_and_two_stages(tmp_path):
    bench = load_script("bench_serve")
    argv = [
        "decode",
        "--device",
        "cpu",
        "--models",
        "tiny",
        "--batches",
        "1,3",
        "--steps",
        "3",
        "--repeats",
        "1",
        "--prompt-len",
        "6",
        "--gpus",
        "1,2",
        "--out",
        str(tmp_path),
    ]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    rows = data["rows"]
    assert {(r["gpus"], r["batch"], r["mode"]) for r in rows} == {(g, b, "eager") for g in (1, 2) for b in (1, 3)}
    for r in rows:
        assert r["per_token_ms"] > 0 and r["decode_steps"] == 3
        assert abs(r["tokens_per_s"] - r["batch"] / (r["per_token_ms"] / 1e3)) < 1e-6 * r["tokens_per_s"]
        assert r["graphs_remove"] is None  # no graph row on CPU
    md = (tmp_path / "bench_decode.md").read_text()
    assert "| stages (GPUs) | batch |" in md and md.count("\n| 1 |") == 2 and md.count("\n| 2 |") == 2
    # results of several machines merge into one table
    assert (
        bench.main(
            [
                "decode",
                "--merge",
                str(tmp_path / "bench_decode.json"),
                str(tmp_path / "bench_decode.json"),
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    assert len(json.loads((tmp_path / "merged" / "bench_decode.json").read_text())["rows"]) == 2 * len(rows)


def test_bench_savings_pairing():
    bench = load_script("benches.serve_decode")
    rows = [
        {"model": "m", "gpus": 1, "batch": 4, "mode": "eager", "per_token_ms": 10.0},
        {"model": "m", "gpus": 1, "batch": 4, "mode": "graphs", "per_token_ms": 4.0},
    ]
    out = bench.add_savings(rows)
    assert out[0]["graphs_remove"] is None and abs(out[1]["graphs_remove"] - 0.6) < 1e-12
