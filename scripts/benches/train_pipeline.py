"""Pipeline training benchmark: every schedule on the same model and batch, through the real `dsaflow train` launch.

    python scripts/bench_train.py pipeline --ranks 2 --steps 8 model=tiny train.seq_len=64             # CPU, gloo
    python scripts/bench_train.py pipeline --ranks 4 --steps 20 model=small train.seq_len=2048 \\
        train.batch_size=32 pipeline.microbatches=8                                                  # 4 GPUs, NCCL

For each schedule: single-stage schedules (GPipe, 1F1B) get `ranks` stages, multi-stage ones (Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) get 2 * ranks (2 per rank). The first `--warmup` steps (shape
inference, allocator and NCCL warm-up) and nothing else are dropped; the rest are averaged from metrics.jsonl.

Reported per schedule (JSON + a markdown table in --out):
  tokens_per_s          train.batch_size * train.seq_len / wall step time (mean)
  step_time_s           wall time of one optimizer step on the logging rank (median)
  efficiency            measured pipeline efficiency = sum over stages of their compute time in the step
                        (forward + backward + weight-backward chunks, CUDA-event timed on GPU, so waiting for a
                        neighbour is excluded) / (ranks * wall step time); 1.0 = no bubble and no overhead
  ideal                 m / (m + p - 1), the bubble-limited bound of GPipe/1F1B with m microbatches, p ranks
  ideal_interleaved     v*m / (v*m + p - 1) for v stages per rank (the bound interleaving aims at)
  mfu                   model FLOPs (6N + sparse attention + indexer, dsaflow/train/metrics.py) * tokens/s over
                        the peak stated there
Efficiency also pays for optimizer, clipping and the metric all-reduce, which the ideal ignores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_lib import environment, out_dir, write_results

SINGLE = ("GPipe", "1F1B")
MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


def run_one(schedule: str, ranks: int, steps: int, overrides, out: Path) -> dict:
    stages = ranks if schedule in SINGLE else 2 * ranks
    run_dir = out / f"run-{schedule}"
    cmd = [
        sys.executable,
        "-m",
        "dsaflow.cli",
        "train",
        *overrides,
        f"pipeline.stages={stages}",
        f"pipeline.ranks={ranks}",
        f"pipeline.schedule={schedule}",
        f"train.steps={steps}",
        "track=none",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.final_ckpt=false",
        "train.progress=lines",
        f"train.log_every={steps}",
        f"run_dir={run_dir}",
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = {"schedule": schedule, "ranks": ranks, "stages": stages, "launch_wall_s": time.time() - t0}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        result["error"] = " | ".join(tail)
        return result
    result["records"] = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    result["plan"] = json.loads((run_dir / "plan.json").read_text())
    return result


def summarize(res: dict, warmup: int) -> dict:
    if "error" in res:
        return {k: res[k] for k in ("schedule", "ranks", "stages", "error")}
    recs = [r for r in res.pop("records") if r["step"] > warmup]
    # The last step also runs the final evaluation afterwards; its step_time_s excludes it, so it is kept.
    plan = res.pop("plan")
    m, p, v = plan["pipeline"]["microbatches"], plan["pipeline"]["ranks"], plan["pipeline"]["stages_per_rank"]
    S = len(plan["stages"])
    out = dict(res, microbatches=m, stages_per_rank=v, steps_measured=len(recs))
    out["tokens_per_s"] = statistics.mean(r["tokens_per_s"] for r in recs)
    out["step_time_s"] = statistics.median(r["step_time_s"] for r in recs)
    out["efficiency"] = statistics.mean(r["pipeline_efficiency"] for r in recs)
    out["ideal"] = m / (m + p - 1)
    out["ideal_interleaved"] = v * m / (v * m + p - 1)
    out["stage_time_s"] = [statistics.mean(r[f"stage{s}_time_s"] for r in recs) for s in range(S)]
    out["loss_last"] = recs[-1]["loss"] if recs else None
    if recs and "mfu" in recs[0]:
        out["mfu"] = statistics.mean(r["mfu"] for r in recs)
    return out


def markdown(rows, args) -> str:
    head = (
        f"# Pipeline training benchmark\n\n{args.ranks} ranks, {args.steps} steps ({args.warmup} warm-up dropped), "
        f"overrides: `{' '.join(args.overrides) or '(defaults)'}`\n\n"
        "| schedule | stages | m | tokens/s | step (s) | efficiency | ideal m/(m+p-1) | ideal interleaved | MFU | "
        "stage compute (s) |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['schedule']} | {r['stages']} | | failed: {r['error'][:120]} | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.2f}%" if "mfu" in r else "n/a"
        st = ", ".join(f"{t:.3f}" for t in r["stage_time_s"])
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['microbatches']} | {r['tokens_per_s']:.0f} | "
            f"{r['step_time_s']:.3f} | {r['efficiency']:.3f} | {r['ideal']:.3f} | {r['ideal_interleaved']:.3f} "
            f"| {mfu} | {st} |"
        )
    notes = (
        "\n\nefficiency = sum of per-stage compute time / (ranks x wall step time); compute time is the sum of "
        "the stage's forward/backward/weight-backward chunks (CUDA events on GPU). See the script docstring.\n"
    )
    return head + "\n".join(lines) + notes


def main(argv=None, prog="bench_train.py pipeline") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped before averaging")
    ap.add_argument("--schedules", default=",".join(SINGLE + MULTI))
    ap.add_argument("--out", default=None, help="output folder (default bench_out/train-<time>)")
    ap.add_argument("overrides", nargs="*", help="hydra overrides for every run (model=..., train.seq_len=...)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    out = out_dir(prog, args.out or f"bench_out/train-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = []
    for sched in args.schedules.split(","):
        print(f"[{prog}] {sched} on {args.ranks} ranks ...", flush=True)
        row = summarize(run_one(sched, args.ranks, args.steps, args.overrides, out), args.warmup)
        print(
            "   ",
            row.get("error")
            or f"{row['tokens_per_s']:.0f} tokens/s, efficiency {row['efficiency']:.3f} (ideal {row['ideal']:.3f})",
            flush=True,
        )
        rows.append(row)
    import torch

    env = environment(
        "cuda" if torch.cuda.is_available() else "cpu",
        cpus=os.cpu_count(),
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    )
    write_results(out, "bench_train", {"env": env, "args": vars(args), "results": rows}, markdown(rows, args))
    return 0 if all("error" not in r for r in rows) else 1
