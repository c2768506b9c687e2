"""The recipes of scripts/quality_table.py: presets, the --pre-stage curriculum, and the `dsaflow train` overrides
of every run it starts (docs/quality.md, "Recipe")."""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

# Recipes. gpu: one H200 per step, a few minutes each; cpu: seconds, for tests and CI (numbers mean nothing).
PRESETS = {
    "gpu": {
        "model": ["model=small"],
        "seq_len": 1024,
        "topk": 64,
        "batch_size": 16,
        "steps": 600,
        "lr": 1e-3,
        "warmup": 50,
        "eval_every": 50,
        "train_eval_batches": 8,
        "calib_batches": 8,
        "eval_batches": 32,
        # the curriculum before the task length, per task (`--pre-stage` replaces it; docs/quality.md, "Recipe"):
        # a 2-pair warm-up whose repeated run forms key lookup, the 8-pair task at 64 tokens, then doubling lengths
        "pre_stages": {
            "retrieval_long": [
                "1250:64:data.num_pairs=2 data.num_queries=1 data.copy_len=24 data.copy_chars=mixed "
                "train.batch_size=256 train.eval_every=250",
                "300:64:train.batch_size=128 train.eval_every=100",
                "300:256:train.batch_size=64 train.eval_every=100",
                "300:512:train.batch_size=32 train.eval_every=100",
                "200:1024:train.batch_size=16 train.eval_every=100",
            ],
        },
        "guess_s": {"base": 420, "every4": 330},  # until a measured time of the step exists (timings.json)
    },
    "cpu": {
        "model": ["model=tiny", "model.dim=32", "model.inter_dim=64"],
        "seq_len": 64,
        "topk": 8,
        "batch_size": 4,
        "steps": 4,
        "lr": 3e-3,
        "warmup": 1,
        "eval_every": 2,
        "train_eval_batches": 1,
        "calib_batches": 1,
        "eval_batches": 2,
        "pre_stages": {},
        "guess_s": {"base": 60, "every4": 30},
    },
}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def task_overrides(task: str, r: dict, text_path: str | None) -> list:
    if task == "retrieval_long":
        return ["data=retrieval_long"]
    return [
        "data=text",
        f"data.path={text_path or stdlib_dir()}",
        "data.suffixes=[.py]",
        "data.exclude=[site-packages/*,dist-packages/*]",
        "data.split=files",
        "data.val_fraction=0.1",
    ]


def recipe(a) -> dict:
    r = dict(PRESETS[a.preset or ("gpu" if a.device == "cuda" else "cpu")])
    r["pre_stages"] = [pre_stage(text) for text in r["pre_stages"].get(a.task, [])]
    for k in ("steps", "seq_len", "topk", "batch_size", "lr", "warmup", "eval_batches", "calib_batches"):
        if getattr(a, k, None) is not None:
            r[k] = getattr(a, k)
    if a.pre_stages is not None:  # --pre-stage replaces the preset's curriculum; `--pre-stage none` drops it
        r["pre_stages"] = [st for st in a.pre_stages if st is not None]
    return r


def pre_stage(text: str) -> dict:
    """--pre-stage "STEPS:SEQ_LEN[:OVERRIDES]" -> {steps, seq_len, overrides (list)}, "none" -> None; argparse
    reports an ArgumentTypeError."""
    if text == "none":
        return None
    parts = text.split(":", 2)
    try:
        steps, seq_len = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f'{text!r}: give STEPS:SEQ_LEN[:OVERRIDES], e.g. "400:64:data.num_pairs=2 train.batch_size=256"'
        ) from None
    if steps < 1 or seq_len < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: STEPS must be >= 1 and SEQ_LEN >= 2")
    return {"steps": steps, "seq_len": seq_len, "overrides": parts[2].split() if len(parts) > 2 else []}


def train_overrides(a, r: dict, task: str, seed: int, index: str, run_dir: Path, steps: int) -> list:
    return [
        *r["model"],
        *task_overrides(task, r, a.text_path),
        f"index={index}",
        f"train.seq_len={r['seq_len']}",
        f"model.index_topk={r['topk']}",
        f"train.batch_size={r['batch_size']}",
        f"train.lr={r['lr']}",
        f"train.warmup_steps={r['warmup']}",
        f"train.steps={steps}",
        f"train.seed={seed}",
        f"train.eval_every={r['eval_every']}",
        f"train.eval_batches={r['train_eval_batches']}",
        f"train.log_every={r['eval_every']}",
        f"train.device={a.device}",
        "train.cpu_threads=1",
        "train.progress=lines",
        f"track={a.track or ('offline' if a.device == 'cuda' else 'none')}",
        f"run_dir={run_dir}",
        *a.set,
    ]
