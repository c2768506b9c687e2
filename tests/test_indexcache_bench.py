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


@pytest.mark.slow
def test_bench_indexcache_short_rows_cpu_tiny(tmp_path):
    """--part short: per-layer sparse and short-path prefill, the plain-torch dense layer, the indexer and key
    projection, the bar and the crossover, consistent in JSON and markdown."""
    bench = load_script("bench_indexcache")
    argv = ["--part", "short", "--device", "cpu", "--model", "tiny", "--short", "16,32,48", "--short-layers", "4"]
    argv += ["--prefill-chunk", "32", "--short-repeats", "1", "--extra", "", "--out", str(tmp_path)]
    argv += ["--short-chunks", "8,16", "--short-chunk-contexts", "32"]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "indexcache_short.json").read_text())
    rows = res["rows"]
    assert [(r["layout"], r["context"], r["short_path"]) for r in rows] == [
        (layout, L, "dense" if L <= 16 else "masked") for layout in ("FFFF", "FSSS") for L in (16, 32, 48)
    ]
    for r in rows:
        assert min(r["sparse_ms_per_layer"], r["short_ms_per_layer"], r["dense_layer_ms"], r["key_proj_ms"]) > 0
        extra = r["key_proj_ms"] if r["short_path"] == "dense" else r["indexer_ms"]
        assert abs(r["bar_ms"] - (r["dense_layer_ms"] + extra * r["f_layers"] / r["layers"])) < 1e-9
        assert r["short_within_bar"] == (r["short_ms_per_layer"] <= r["bar_ms"])
        assert abs(r["short_speedup_vs_sparse"] - r["sparse_ms_per_layer"] / r["short_ms_per_layer"]) < 1e-6
        # the engine's own rule: top-k 16 < MIN_PREFILL_TOKENS, so no chunk is worth a dense or split pass
        assert r["auto_path"] == "sparse" and r["auto_ms_per_layer"] > 0
        assert r["auto_within_bar"] == (r["auto_ms_per_layer"] <= r["bar_ms"])
    cross = res["crossover"]
    for index in ("all_full", "every4"):
        wins = [r["short_speedup_vs_sparse"] > 1 for r in rows if r["index"] == index and r["context"] > 16]
        expected = {(True, True): 48, (True, False): 32}.get(tuple(wins), 0)
        assert cross[index] == expected
    assert cross["suggested"] == min(cross["all_full"], cross["every4"])
    sweep = res["chunk_sweep"]
    assert [(r["context"], r["chunk"]) for r in sweep] == [(32, 8), (32, 16)]
    wins = [r["short_speedup_vs_sparse"] > 1 for r in sweep]
    assert res["min_tokens"][str(32)] == {(True, True): 8, (False, True): 16}.get(tuple(wins))
    md = (tmp_path / "indexcache_short.md").read_text()
    assert md.count("\n| FFFF |") == 3 and md.count("\n| FSSS |") == 3 and "suggested MASKED_RATE" in md
    rates = res["masked_rates"]
    assert [r["context"] for r in rates] == [32, 48] and all(r["rate"] > 0 and r["masked_ms"] > 0 for r in rates)
    assert res["suggested_masked_rate"] == min(r["rate"] for r in rates)


def test_crossover_stops_at_the_first_context_where_masked_loses():
    short = load_script("indexcache_short")
    rows = [
        {"index": "a", "context": c, "short_speedup_vs_sparse": s}
        for c, s in ((8, 9.0), (32, 2.0), (64, 1.2), (128, 0.9), (256, 1.5))
    ]
    assert short.crossover(rows, topk=16) == {"a": 64, "suggested": 64}
    assert short.crossover([{**rows[1], "short_speedup_vs_sparse": 0.5}], topk=16) == {"a": 0, "suggested": 0}
    sweep = [{"context": 64, "chunk": c, "short_speedup_vs_sparse": s} for c, s in ((8, 1.5), (16, 0.8), (32, 1.1))]
    assert short.min_tokens(sweep) == {64: 32, "suggested": 32}
    assert short.min_tokens([{**sweep[1], "context": 8}, *sweep]) == {8: None, 64: 32, "suggested": None}
