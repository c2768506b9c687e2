"""Time one rank's training step (`Trainer.step`, the code `dsaflow train` runs) in this process, for several
`pipeline.microbatches` values on the same config, and count what a step launches.

    python scripts/bench_train.py step --device cuda --microbatches 4,1 --out bench_out/train_step \\
        model=small data=retrieval_long train.seq_len=1024 model.index_topk=64 train.batch_size=16

On one stage, microbatches are gradient accumulation: the same tokens, each part a full set of kernel launches. A
small model on a GPU is bound by those launches; this shows by how much. Each row: step_ms (mean over --steps
steps after --warmup, device-synchronised), tokens_per_s, busy_ms (the stage's own compute time as the trainer
measures it, CUDA events on a GPU) and, with --profile, kernels (launches in one profiled step) and kernel_ms (their
summed GPU time; on CPU: none). Writes bench_train_step.json and bench_train_step.md into --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_lib import environment, kernel_times, out_dir, resolve_device, sync, write_results


def parse_args(argv=None, prog="bench_train.py step") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--microbatches", default="4,1", help="comma-separated pipeline.microbatches values")
    p.add_argument("--steps", type=int, default=8, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (shape inference, autotuning)")
    p.add_argument("--profile", action="store_true", help="also count the kernels of one step (torch.profiler)")
    p.add_argument("--out", default="bench_out/train_step")
    p.add_argument("overrides", nargs="*", help="dsaflow config overrides (key=value), e.g. model=small")
    a = p.parse_args(argv)
    try:
        a.microbatches = [int(x) for x in a.microbatches.split(",")]
    except ValueError:
        p.error(f"--microbatches={a.microbatches!r}: give comma-separated integers, e.g. --microbatches 4,1")
    a.device = resolve_device(prog, a.device)
    return a


def make_trainer(overrides: list, device: torch.device):
    from dsaflow.config.compose import compose
    from dsaflow.pipeline.run_context import RunContext
    from dsaflow.plan import build_plan
    from dsaflow.train.trainer import Trainer

    cfg = compose(["track=none", f"train.device={device.type}", *overrides])
    return Trainer(RunContext(cfg, build_plan(cfg), 0, 1, 0, device, Path(tempfile.mkdtemp())))


def count_kernels(tr, step: int, device: torch.device) -> tuple:
    """(kernels launched, their summed GPU ms) in one profiled step; (None, None) on CPU."""
    if device.type != "cuda":
        return None, None
    rows = kernel_times(lambda: tr.step(step), device)
    return int(sum(calls for _, _, calls in rows)), sum(ms for _, ms, _ in rows)


def bench_row(overrides: list, mb: int, a, device: torch.device) -> dict:
    tr = make_trainer([*overrides, f"pipeline.microbatches={mb}", f"train.steps={a.warmup + a.steps + 2}"], device)
    for s in range(a.warmup):
        tr.step(s)
    sync(device)
    t0 = time.perf_counter()
    busy = sum(tr.step(a.warmup + s)["stage0_time_s"] for s in range(a.steps))
    sync(device)
    step_s = (time.perf_counter() - t0) / a.steps
    kernels, kernel_ms = count_kernels(tr, a.warmup + a.steps, device) if a.profile else (None, None)
    return {
        "microbatches": mb,
        "tokens_per_step": tr.tokens_per_step,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tr.tokens_per_step / step_s,
        "busy_ms": busy / a.steps * 1e3,
        "kernels": kernels,
        "kernel_ms": kernel_ms,
    }


def markdown(rows: list, meta: dict) -> str:
    lines = [
        f"Trainer step, {meta['device_name']}, overrides: `{' '.join(meta['overrides']) or '(defaults)'}`",
        "",
        "| microbatches | tokens/step | step ms | tokens/s | stage busy ms | kernels | kernel ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        k = "" if r["kernels"] is None else f"{r['kernels']:,}"
        km = "" if r["kernel_ms"] is None else f"{r['kernel_ms']:.1f}"
        lines.append(
            f"| {r['microbatches']} | {r['tokens_per_step']:,} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['busy_ms']:.1f} | {k} | {km} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None, prog="bench_train.py step") -> int:
    a = parse_args(argv, prog)
    out = out_dir(prog, a.out)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = []
        for mb in a.microbatches:
            rows.append(bench_row(a.overrides, mb, a, device))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        dist.destroy_process_group()
    meta = environment(device, overrides=a.overrides, steps=a.steps)
    write_results(out, "bench_train_step", {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0
