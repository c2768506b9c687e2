"""scripts/bench_indexcache.py runs end to end on CPU at tiny size (eager decode; graphs need CUDA) and writes
consistent JSON and markdown (speedups are the ratios of the measured times, shares of the measured prefill)."""

import json

import pytest
import torch
from script_helpers import load_script


@pytest.mark.slow
def test_bench_indexcache_cpu_tiny(tmp_path):
    bench = load_script("bench_indexcache")
    argv = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--layers",
        "4",
        "--contexts",
        "24,40",
        "--prefill-chunk",
        "16",
        "--decode-steps",
        "2",
        "--sdpa-repeats",
        "1",
        "--indexes",
        "all_full,every4",
        "--extra",
        "",
        "--out",
        str(tmp_path),
    ]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "indexcache.json").read_text())
    rows = res["rows"]
    assert [(r["index"], r["context"], r["f_layers"]) for r in rows] == [
        ("all_full", 24, 4),
        ("all_full", 40, 4),
        ("every4", 24, 1),
        ("every4", 40, 1),
    ]
    full = {r["context"]: r for r in rows if r["index"] == "all_full"}
    for r in rows:
        assert (
            r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0 and r["dense_sdpa_ms"] > 0 and r["dense_model_ms"] > 0
        )
        assert abs(r["vs_dense_model"] - r["dense_model_ms"] / r["prefill_ms"]) < 1e-9
        f = full[r["context"]]
        assert abs(r["prefill_speedup_vs_all_f"] - f["prefill_ms"] / r["prefill_ms"]) < 1e-9
        assert abs(r["decode_speedup_vs_all_f"] - r["decode_tokens_per_s"] / f["decode_tokens_per_s"]) < 1e-9
        assert abs(r["indexer_share"] - r["indexer_ms"] / r["prefill_ms"]) < 1e-9
        assert r["decode_graphs"] is False
    assert res["paper"]["prefill_1_4"] == [1.27, 1.31, 1.51, 1.82]
    md = (tmp_path / "indexcache.md").read_text()
    assert md.count("\n| all_full |") == 2 and md.count("\n| every4 |") == 2


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_share_times_the_op_in_the_models_precision(monkeypatch, fp8):
    """`model.index_fp8` reaches the timed indexer op, so an fp8 table's indexer share is the fp8 op's."""
    bench = load_script("bench_indexcache")
    seen = []
    monkeypatch.setattr(bench, "indexer_topk", lambda *a, fp8=False, **k: seen.append(fp8))

    class Model:
        index_head_dim, index_n_heads, index_topk, index_fp8 = 16, 2, 4, fp8

    bench.indexer_op_seconds(Model, ctx=32, chunk=16, device=torch.device("cpu"), dtype=torch.float32)
    assert seen == [fp8] * 4  # two chunks, each an untimed and a timed call
