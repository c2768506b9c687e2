"""The training-free greedy IndexCache layer search, with a resumable log.

Start with every layer F. At each step, try turning each remaining F layer to S (the first layer of every stage is
never a candidate: it must stay F, so the result needs no promotion; with cross-stage indices only layer 0 is kept),
keep the one whose change raises the calibration LM loss the least, and repeat until `target_f` F layers remain.
Ties go to the lower layer index.

Every candidate evaluation and every chosen step is appended to a JSONL log as soon as it is known; a rerun with the
same settings replays the log and continues where the interrupted run stopped (mid-step included).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .evaluate import PatternEvaluator, Score


@dataclass
class Step:
    step: int  # 0 = all F
    removed: Optional[int]  # layer turned to S at this step (None at step 0)
    num_f: int
    loss: float  # calibration loss of the pattern after this step
    acc: float
    roles: str  # e.g. "FSFFFFFF"


class SearchLog:
    """Append-only JSONL: {"kind": "header", ...}, {"kind": "candidate", step, layer, loss, acc},
    {"kind": "step", ...Step}. A header that differs from the current settings means the log belongs to another
    search: `SearchLog.open` refuses to mix them (restart=True starts afresh)."""

    def __init__(self, path: Path, header: dict, restart: bool = False):
        self.path = Path(path)
        self.candidates: Dict[Tuple[int, int], Score] = {}
        self.steps: List[Step] = []
        if self.path.is_file() and not restart:
            lines = [json.loads(l) for l in self.path.read_text().splitlines() if l.strip()]
            old = lines[0] if lines and lines[0].get("kind") == "header" else {}
            if {k: v for k, v in old.items() if k != "kind"} != header:
                raise ValueError(
                    f"{self.path} holds a search with other settings ({_diff(old, header)}). Fix: use another "
                    f"search.out_dir, or search.restart=true to discard it."
                )
            for rec in lines[1:]:
                if rec["kind"] == "candidate":
                    self.candidates[(rec["step"], rec["layer"])] = Score(rec["loss"], _num(rec["acc"]))
                elif rec["kind"] == "step":
                    self.steps.append(
                        Step(**{k: (_num(v) if k == "acc" else v) for k, v in rec.items() if k != "kind"})
                    )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"kind": "header", **header}) + "\n")

    def _append(self, rec: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def add_candidate(self, step: int, layer: int, score: Score) -> None:
        self.candidates[(step, layer)] = score
        self._append({"kind": "candidate", "step": step, "layer": layer, "loss": score.loss, "acc": _js(score.acc)})

    def add_step(self, s: Step) -> None:
        self.steps.append(s)
        self._append({"kind": "step", **{k: (_js(v) if k == "acc" else v) for k, v in asdict(s).items()}})


def _num(v):
    return float("nan") if v is None else v


def _js(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new) - {"kind"})
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k) and k != "kind")


def greedy_search(
    evaluator: PatternEvaluator,
    fixed_f: Sequence[int],
    target_f: int,
    log: SearchLog,
    report: Callable[[str], None] = print,
) -> List[Step]:
    """-> the trajectory [Step 0 (all F), Step 1, ...] down to `target_f` F layers (>= len(fixed_f))."""
    L = evaluator.num_layers
    fixed = set(fixed_f)
    if not len(fixed) <= target_f <= L:
        raise ValueError(
            f"target of {target_f} F layers is outside {len(fixed)}..{L} (the stages' first layers "
            f"{sorted(fixed)} always stay F)."
        )
    roles = ["F"] * L
    steps: List[Step] = []
    for s in log.steps:  # replay what an earlier run already decided (a shared prefix when the target moved up)
        if s.removed is not None and roles.count("F") <= target_f:
            break
        if s.removed is not None:
            roles[s.removed] = "S"
        steps.append(s)
    total_steps = L - target_f
    if not steps:
        base = evaluator.rebase(tuple(roles))
        s0 = Step(0, None, L, base.loss, base.acc, "".join(roles))
        log.add_step(s0)
        steps.append(s0)
        report(f"search: all {L} layers F: calibration loss {base.loss:.4f}")
    else:
        evaluator.rebase(tuple(roles))
        report(
            f"search: resumed after step {steps[-1].step}/{total_steps} ({''.join(roles)}, calibration loss "
            f"{steps[-1].loss:.4f})"
        )
    while roles.count("F") > target_f:
        k = len(steps)
        cands = [i for i in range(L) if roles[i] == "F" and i not in fixed]
        scores: Dict[int, Score] = {}
        for n, c in enumerate(cands, 1):
            if (k, c) in log.candidates:
                scores[c] = log.candidates[(k, c)]
                continue
            trial = list(roles)
            trial[c] = "S"
            scores[c] = evaluator.score(tuple(trial))
            log.add_candidate(k, c, scores[c])
            report(
                f"search: step {k}/{total_steps} candidate {n}/{len(cands)}: layer {c} -> S gives calibration "
                f"loss {scores[c].loss:.4f}"
            )
        best = min(cands, key=lambda c: (scores[c].loss, c))
        roles[best] = "S"
        evaluator.rebase(tuple(roles))
        st = Step(k, best, roles.count("F"), scores[best].loss, scores[best].acc, "".join(roles))
        log.add_step(st)
        steps.append(st)
        report(
            f"search: step {k}/{total_steps}: layer {best} -> S ({st.roles}, {st.num_f} F), calibration loss "
            f"{st.loss:.4f}"
        )
    return steps
