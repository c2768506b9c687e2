"""train.on_nonfinite: a NaN/inf loss or gradient norm stops the run (default) with one paragraph, keeping the last
good checkpoint and a metrics.jsonl that is valid JSON; `skip` goes on and says so."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_harness import TINY_RUN

from dsaflow.checkpoint.store import verify_checkpoint
from dsaflow.errors import PlanError
from dsaflow.rundir.folder import list_checkpoints
from dsaflow.train.nonfinite import NonFiniteGuard, json_record, nonfinite_flag

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_RUN


def test_the_flag_sees_nan_and_inf_on_any_tensor():
    finite = [torch.ones(3), torch.tensor(2.0)]
    assert float(nonfinite_flag(finite, "cpu")) == 0.0
    assert float(nonfinite_flag([*finite, torch.tensor([1.0, math.inf])], "cpu")) == 1.0
    assert float(nonfinite_flag([torch.tensor(math.nan, requires_grad=True)], "cpu")) == 1.0


def test_records_stay_json_and_name_what_was_not_finite():
    line = json_record({"step": 3, "loss": math.nan, "grad_norm": math.inf, "lr": 0.1})
    assert json.loads(line) == {
        "step": 3,
        "loss": None,
        "grad_norm": None,
        "lr": 0.1,
        "nonfinite": ["grad_norm", "loss"],
    }
    assert json.loads(json_record({"step": 1, "loss": 2.5})) == {"step": 1, "loss": 2.5}


def test_skip_warns_on_the_first_bad_step_and_then_sparsely():
    said = []
    guard = NonFiniteGuard("skip")
    for step in range(1, 11):
        guard.after_step(step, {"loss": 1.0, "indexer_loss": math.nan, "grad_norm": 1.0}, said.append)
    guard.after_step(11, {"loss": 1.0, "grad_norm": 1.0, "nonfinite_losses": 0.0}, said.append)  # a good step
    assert guard.bad_steps == 10 and len(said) == 4  # steps 1, 2, 4 and 8 of the bad ones
    assert "step 1: indexer_loss not finite" in said[0] and "8 such steps" in said[3]
    with pytest.raises(PlanError, match="step 5: a stage's loss not finite"):
        NonFiniteGuard("stop").after_step(5, {"loss": 1.0, "nonfinite_losses": 1.0}, said.append)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a real launch")
def test_a_diverging_run_stops_keeps_its_last_good_checkpoint_and_valid_metrics(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    args = [*TINY, "train.lr=10", "train.steps=8", "train.ckpt_every=1", f"run_dir={run}"]
    r = subprocess.run(
        [sys.executable, "-m", "dsaflow.cli", "train", *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "train.on_nonfinite=stop" in r.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # valid JSON
    bad = records[-1]
    assert bad["nonfinite"] and all(bad[k] is None for k in bad["nonfinite"])
    assert f"training stopped at step {bad['step']}" in r.stderr and bad["step"] < 8
    saved = [step for step, _ in list_checkpoints(run)]
    assert saved and max(saved) == bad["step"] - 1  # nothing saved from the bad step on
    for _, folder in list_checkpoints(run):
        verify_checkpoint(folder)
