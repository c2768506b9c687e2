"""What the parent prints when a run ends: where everything is, the final metrics, and how to sync an offline run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def shell_command(cmd: List[str]) -> str:
    """A command line a user can copy-paste into a shell (quoted where needed)."""
    return shlex.join(str(c) for c in cmd)


def train_summary(cfg, run_dir, rc: int) -> str:
    """Lines for the end of `dsaflow train`: run dir, checkpoint, final metrics, the `wandb sync` command."""
    from dsaflow.checkpoint.store import newest_good_checkpoint
    from dsaflow.track.sweep_summary import final_metrics

    run_dir = Path(run_dir)
    m = final_metrics(run_dir)
    # the newest complete checkpoint, sizes checked, not hashed: the run just wrote it, and `dsaflow generate` or a
    # resume verifies it in full before loading
    ck = newest_good_checkpoint(run_dir, quick=True)
    head = "training finished" if rc == 0 else f"training stopped (exit status {rc})"
    lines = [f"{head}: {run_dir}"]
    if m:
        shown = [f"step {m['step']}"] if "step" in m else []
        for k, fmt in (
            ("loss", ".4f"),
            ("indexer_loss", ".4g"),
            ("eval_loss", ".4f"),
            ("eval_acc", ".3f"),
            ("eval_bpb", ".4f"),
            ("tokens_per_s", ",.0f"),
        ):
            if m.get(k) is not None:  # null: a non-finite value (metrics.jsonl stays JSON)
                shown.append(f"{k} {m[k]:{fmt}}")
        lines.append("  final:      " + ", ".join(shown))
    lines.append(f"  checkpoint: {ck[1] if ck else '(none saved)'}")
    lines.append(f"  metrics:    {run_dir / 'metrics.jsonl'} (log: {run_dir / 'train.log'})")
    if cfg.track.backend == "wandb" and cfg.track.mode == "offline":
        runs = sorted((run_dir / "wandb").glob("offline-run-*"))
        target = shell_command([str(runs[-1])]) if runs else shlex.quote(str(run_dir / "wandb")) + "/offline-run-*"
        lines.append(f"  wandb:      offline run; upload with: wandb sync {target}")
    if ck and rc == 0:
        # A prompt of the run's own data: a retrieval query answered by one token, or the start of a text.
        ask = (
            "serve.max_new_tokens=1 serve.prompts='[\"qmzj xwv K7; pllr ?K\"]'"
            if str(cfg.data.kind) == "retrieval"
            else "serve.prompts='[\"The \"]'"
        )
        lines.append(
            f"  next:       dsaflow generate serve.checkpoint={shlex.quote(str(run_dir))} {ask}   (docs/serving.md)"
        )
    return "\n".join(lines)
