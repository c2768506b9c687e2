"""Kill-and-resume equality: a run stopped after step 3 (checkpoint at step 2) and resumed from its run dir logs the
same per-step losses as an uninterrupted run (2 ranks x 2 stages each, gloo, DCP checkpoints)."""

from __future__ import annotations

import pytest
from train_harness import run_configs, stop_and_resume_cfgs

from dsaflow.checkpoint.store import newest_good_checkpoint
from dsaflow.rundir.folder import read_metrics


@pytest.mark.slow
def test_stop_and_resume_matches_uninterrupted(tmp_path):
    common = dict(steps=4, ckpt_every=2, dense_warmup_steps=1, eval_every=2)
    full, stopped, resumed = stop_and_resume_cfgs(tmp_path, 4, 2, "Interleaved1F1B", 3, **common)
    r_full, r_stopped, r_resumed = run_configs(2, [full, stopped, resumed], tmp_path / "out")

    assert [h["step"] for h in r_stopped["history"]] == [1, 2, 3]
    assert [h["step"] for h in r_resumed["history"]] == [3, 4], "resume must continue after the step-2 checkpoint"
    assert newest_good_checkpoint(stopped.run_dir)[0] == 4
    # metrics.jsonl of the interrupted run dir: step 3 of the killed attempt is dropped, then 3 and 4 re-logged.
    logged = read_metrics(stopped.run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    want = [r["loss"] for r in read_metrics(full.run_dir)]
    assert [r["loss"] for r in logged] == want, "resumed losses differ from the uninterrupted run"
    assert [r.get("eval_acc") for r in logged] == [r.get("eval_acc") for r in read_metrics(full.run_dir)]
    assert r_resumed["history"][0]["loss"] == r_stopped["history"][2]["loss"] == want[2]
