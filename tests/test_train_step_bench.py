"""`scripts/bench_train.py step` times the trainer's step on CPU for several microbatch counts of one config and
writes matching JSON and markdown; a malformed --microbatches exits 2."""

import json

import pytest
from script_helpers import load_script


def test_bench_train_step_cpu(tmp_path):
    bench = load_script("bench_train")
    argv = ["step", "--device", "cpu", "--steps", "1", "--warmup", "1", "--microbatches", "2,1", "--out", str(tmp_path)]
    assert bench.main(argv + ["model.num_layers=2", "train.seq_len=32", "train.batch_size=4"]) == 0
    data = json.loads((tmp_path / "bench_train_step.json").read_text())
    rows = data["rows"]
    assert [r["microbatches"] for r in rows] == [2, 1]
    assert {r["tokens_per_step"] for r in rows} == {4 * 32}  # the same tokens, split or whole
    for r in rows:
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1e3)
        assert 0 < r["busy_ms"] <= r["step_ms"] and r["kernels"] is None  # no kernel count on CPU
    md = (tmp_path / "bench_train_step.md").read_text()
    assert md.count("\n| ") == 1 + len(rows) and "model.num_layers=2" in md


def test_bench_train_step_refuses_a_bad_microbatch_list(capsys):
    bench = load_script("bench_train")
    with pytest.raises(SystemExit) as e:
        bench.main(["step", "--microbatches", "4,x"])
    assert e.value.code == 2 and "--microbatches='4,x'" in capsys.readouterr().err
