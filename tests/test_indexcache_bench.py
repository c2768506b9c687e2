"""scripts/bench_indexcache.py runs end to end on CPU at tiny size (eager decode; graphs need CUDA) and writes
consistent JSON and markdown (speedups are the ratios of the measured times, shares of the measured prefill)."""
import json

import pytest

from script_helpers import load_script


@pytest.mark.slow
def test_bench_indexcache_cpu_tiny(tmp_path):
    bench = load_script("bench_indexcache")
    argv = ["--device", "cpu", "--model", "tiny", "--layers", "4", "--contexts", "24,40", "--prefill-chunk", "16",
            "--decode-steps", "2", "--sdpa-repeats", "1", "--indexes", "all_full,every4", "--extra", "",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "indexcache.json").read_text())
    rows = res["rows"]
    assert [(r["index"], r["context"], r["f_layers"]) for r in rows] == [
        ("all_full", 24, 4), ("all_full", 40, 4), ("every4", 24, 1), ("every4", 40, 1)]
    full = {r["context"]: r for r in rows if r["index"] == "all_full"}
    for r in rows:
        assert r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0 and r["dense_sdpa_ms"] > 0 and r["dense_model_ms"] > 0
        assert abs(r["vs_dense_model"] - r["dense_model_ms"] / r["prefill_ms"]) < 1e-9
        f = full[r["context"]]
        assert abs(r["prefill_speedup_vs_all_f"] - f["prefill_ms"] / r["prefill_ms"]) < 1e-9
        assert abs(r["decode_speedup_vs_all_f"] - r["decode_tokens_per_s"] / f["decode_tokens_per_s"]) < 1e-9
        assert abs(r["indexer_share"] - r["indexer_ms"] / r["prefill_ms"]) < 1e-9
        assert r["decode_graphs"] is False
    assert res["paper"]["prefill_1_4"] == [1.27, 1.31, 1.51, 1.82]
    md = (tmp_path / "indexcache.md").read_text()
    assert md.count("\n| all_full |") == 2 and md.count("\n| every4 |") == 2
