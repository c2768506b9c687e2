"""Non-finite training, seen and decided: `train.on_nonfinite=stop` (default) or `skip`.

Detection stays on the device: `nonfinite_flag` turns the step's losses (LM loss on the last stage, indexer losses
on every stage) into one float64 scalar that rides in the step's existing all-reduce of per-stage metrics, so no
rank adds a host sync; the global gradient norms are host floats the step already has (clipping needs them). Every
rank therefore sees the same verdict at the same step, and all stop together.

  * A non-finite global gradient norm skips that optimiser's update on every rank (the step always did so).
  * `stop`: the step's record is logged (its non-finite values as JSON null, their names under "nonfinite"), then
    the run ends with one paragraph naming the step and what to change (exit status 2). Nothing is saved after the
    bad step, so the newest checkpoint is the last good one.
  * `skip`: the run goes on, updates of bad steps skipped; a warning names the first bad step and each later one
    whose count is a power of two, so a run that keeps skipping says so without flooding the log.
"""

from __future__ import annotations

import json
import math
from typing import Iterable, List, Mapping

import torch

from dsaflow.errors import PlanError

CHECKED = ("loss", "indexer_loss", "grad_norm", "indexer_grad_norm")


def nonfinite_flag(tensors: Iterable[torch.Tensor], device) -> torch.Tensor:
    """1.0 (float64, on `device`) when any value of `tensors` is NaN or infinite, else 0.0. No host sync."""
    flag = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        flag = torch.maximum(flag, (~torch.isfinite(t.detach())).any().double())
    return flag


def bad_values(m: Mapping) -> List[str]:
    """Names of the metrics of a step that are non-finite floats."""
    return [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]


def json_record(record: Mapping) -> str:
    """One metrics.jsonl line: valid JSON (non-finite floats become null, their names listed under "nonfinite")."""
    bad = bad_values(record)
    if not bad:
        return json.dumps(dict(record), allow_nan=False)
    clean = {k: (None if k in bad else v) for k, v in record.items()}
    clean["nonfinite"] = sorted(set(bad) | set(record.get("nonfinite") or []))
    return json.dumps(clean, allow_nan=False)


class NonFiniteGuard:
    """The verdict of train.on_nonfinite after each step (identical on every rank)."""

    def __init__(self, policy: str):
        self.policy, self.bad_steps = str(policy), 0

    def after_step(self, step: int, m: Mapping, say) -> None:
        """`m`: the step's metrics (`nonfinite_losses` from the all-reduce, grad norms). Raises PlanError (stop) or
        calls `say(line)` (skip) when the step was not finite."""
        bad = [k for k in CHECKED if isinstance(m.get(k), float) and not math.isfinite(m[k])]
        if m.get("nonfinite_losses", 0.0) > 0 and not {"loss", "indexer_loss"} & set(bad):
            bad.append("a stage's loss")
        if not bad:
            return
        self.bad_steps += 1
        what = ", ".join(bad)
        if self.policy == "stop":
            raise PlanError(
                f"training stopped at step {step}: {what} not finite (NaN or inf), and train.on_nonfinite=stop. "
                "Nothing was saved after the last good checkpoint. Fix: lower train.lr or train.indexer_lr (or clip "
                "harder with train.grad_clip); train.on_nonfinite=skip skips such steps and goes on."
            )
        if self.bad_steps & (self.bad_steps - 1) == 0:
            say(
                f"warning: step {step}: {what} not finite; its updates were skipped (train.on_nonfinite=skip; "
                f"{self.bad_steps} such step{'s' * (self.bad_steps != 1)} so far)"
            )
