"""Serving benchmark: output tokens/s, time to first token, time per output token and per-rank busy fractions, for
pipeline splits x microbatch groups x workloads, and continuous against fixed batches.

    python scripts/bench_serve.py engine --device cpu --pipelines single,pp2 --out bench_out/serve   # ~20 min, 2 cores
    python scripts/bench_serve.py engine --device cuda --pipelines single,pp2,pp4 --out bench_out/serve_gpu
    python scripts/bench_serve.py engine --device cuda --pipelines pp2,pp2x2 --out bench_out/serve_replicas  # 4 GPUs

Every configuration serves the same requests through `PipelineEngine.generate` (random-init weights; the schedule,
not the text, is measured). pipeline=single runs in this process; ppN runs N processes under torchrun (gloo on CPU,
NCCL with one GPU per rank on CUDA; a ppN that needs more GPUs than the machine has is skipped and listed as such,
never run on a shared GPU). On CPU every process uses one thread (--threads), so pp2 on a 2-core machine is one core
per rank. `ppNxR` (e.g. pp2x2) is R serving replicas of ppN (`dsaflow generate parallel.dp=R`): N x R processes,
replica d serving requests d, d + R, ... (dsaflow.serve.replicas); the replicas start together after a barrier, and
the row's tokens/s is all their tokens over the slowest replica's wall time, with each replica's own tokens/s in
`replica_tokens_per_s` (and a check against ppN's row, when both ran). Workloads: `mixed` (prompt lengths log-uniform in [--mixed-prompt], max_new_tokens uniform in [--mixed-new])
and `uniform` (every prompt --uniform-prompt tokens, --uniform-new new tokens). Each (pipeline, workload) runs with
serve.microbatches=1 (one group: one batch through the stages at a time) and the default (one group per rank), and
the mixed workload also with fixed batches (a group takes new requests only once all its rows finished).
--max-pass-tokens B1,B2 adds, per workload, continuous rows with mixed passes (serve.max_pass_tokens=B: every pass
carries the decoding rows' tokens and prompt chunks up to B tokens, token-major; decode-only passes keep the decode
graphs), one per budget, with the budget as a column and the share of passes that were mixed. --mixed-graphs on,off
(CUDA) runs each of those rows with mixed passes replayed from graphs of padded token-count classes (graphs=
decode_mixed, classes 64, 128, ... and the budget) and eager (graphs=decode), one row each, `mixed_graphs` a column.
--profile-passes (CUDA, pipeline=single) adds each row's GPU time per pass kind (`pass_profile`: decode / prefill
calls, ms, mean ms), from CUDA events around every stage call, read once after the run.

Busy fraction of a rank = time its stages computed / wall time (perf_counter on CPU, CUDA events on GPU); `decode`
counts only ticks in which every pass in flight was a decode step. Writes <out>/bench_serve.json, bench_serve.md and
bench_serve.png (matplotlib); while it runs, every measured row is also appended to <out>/bench_serve.partial.jsonl,
so a run stopped by a time limit keeps what it measured (the file is removed once the full results are written).
Each configuration prints a line when it starts and every minute while it serves, and its row when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import time
from pathlib import Path

import torch
from bench_lib import (
    Heartbeat,
    command_line,
    environment,
    out_dir,
    rows_from_ranks,
    user_error,
    write_rank_rows,
    write_results,
)

from benches.serve_report import checks, coarse_segments, host_line, markdown, plot
from benches.serve_setup import (
    RANKS,
    add_options,
    arrival_times,
    finish_args,
    make_cfg,
    processes,
    runs_of,
    split_of,
    workload,
)
from dsaflow.serve.engine import PipelineEngine
from dsaflow.serve.generate import build_stage_modules, serve_dtype

ENTRY = Path(__file__).resolve().parents[1] / "bench_serve.py"  # what torchrun starts on every rank
PROG = "bench_serve.py engine"


def parse_args(argv=None, prog: str = PROG):
    """Options -> args with the device's defaults filled in."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pipelines",
        default="single,pp2",
        help="comma separated: single, pp2, pp4, or ppNxR: R serving replicas of ppN (N x R processes)",
    )
    add_options(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pipeline", default="single", help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    return finish_args(ap, ap.parse_args(argv), prog)


def pct(values, q: float):
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


class PassTimer:
    """CUDA events around every stage call of an engine (row moves on a refill included): GPU milliseconds per pass
    kind, read once after the run, so the timed run never waits on them."""

    def __init__(self, eng: PipelineEngine):
        self.marks = []
        inner = eng._forward

        def stage(p, index, x):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(p, index, x)
            end.record()
            self.marks.append(("decode" if p.decode_only else "mixed" if p.token_major else "prefill", start, end))
            return out

        eng._forward = stage  # the tick looks the stage forward up on every call

    def summary(self) -> dict:
        torch.cuda.synchronize()
        out = {}
        for kind, start, end in self.marks:
            entry = out.setdefault(kind, {"calls": 0, "ms": 0.0})
            entry["calls"] += 1
            entry["ms"] += start.elapsed_time(end)
        for entry in out.values():
            entry["mean_ms"] = entry["ms"] / entry["calls"]
        return out


def count_passes(eng: PipelineEngine) -> dict:
    """Count the passes the engine prepares by kind (decode, prefill, mixed: token-major with decoding rows) into
    the returned dict, as the engine runs."""
    kinds = {"decode": 0, "prefill": 0, "mixed": 0}
    inner = eng._prepare

    def prepare(p):
        kind = "decode" if p.decode_only else "mixed" if p.token_major and any(p.decode) else "prefill"
        kinds[kind] += 1
        return inner(p)

    eng._prepare = prepare
    return kinds


def write_trace(eng: PipelineEngine, prompts, limits, path: Path) -> None:
    """Serve `prompts` under torch.profiler (host and, on CUDA, kernel activity) -> a gzipped Chrome trace at
    `path` (open it in Perfetto: per rank, where the host and the GPU spend each tick)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        eng.generate(prompts, limits)
    prof.export_chrome_trace(str(path))
    print(f"  trace: {path}", flush=True)


def partial_path(args) -> Path:
    """Rows as they are measured, one JSON object a line: what an interrupted run (a time limit, a crash in a later
    configuration) keeps. A finished run's rows are in bench_serve.json, and this file is removed."""
    return Path(args.out) / "bench_serve.partial.jsonl"


def keep_row(args, row: dict) -> None:
    path = partial_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def measure(args, pipeline: str, rank: int, device: torch.device, link, gather, every_rank: bool = False) -> list:
    """Every (workload, groups, batching) of one pipeline split on this rank -> rows (on the last stage's rank of
    replica 0, or on this rank with `every_rank`: `bench_serve.py rank` runs one rank alone). rank: the global rank
    (ppNxR: replica rank // N serves every R-th request on pipeline rank rank % N)."""
    base, replicas = split_of(pipeline)
    replica, prank = divmod(rank, RANKS[base])
    first = replica * RANKS[base]  # the replica's global ranks are first .. first + N - 1
    rows = []
    loads = {w: workload(args, w, 256) for w in args.workloads.split(",")}
    context = max(len(p) + m for ps, ms in loads.values() for p, m in zip(ps, ms))
    cfg0, plan0 = make_cfg(args, pipeline, 1, context)
    dtype = serve_dtype("auto", device)
    stages = build_stage_modules(cfg0, plan0, None if base == "single" else prank, device, dtype)
    runs = runs_of(args, pipeline)
    for i, (w, mb, continuous, budget, mixed_graphs) in enumerate(runs):
        label = f"{pipeline} {w} {'continuous' if continuous else 'fixed'} serve.microbatches={mb or 'default'}"
        label += f" serve.max_pass_tokens={budget} mixed graphs {mixed_graphs}" if budget else ""
        loud = rank == 0 or every_rank  # one process speaks for a split
        if loud:
            print(f"[{pipeline} {i + 1}/{len(runs)}] {label}: capture, warm-up, {args.requests} requests", flush=True)
        cfg, plan = make_cfg(args, pipeline, mb, context, continuous, budget, mixed_graphs == "on")
        eng = PipelineEngine(
            cfg.model, plan, stages, cfg.serve, cfg.graphs, device, dtype, prank, link, peer=lambda r: first + r
        )
        kinds = count_passes(eng)
        captured = [r for r in eng.capture().records if r.captured]
        capture = gather(
            (len(captured), sum(r.capture_ms for r in captured) / 1e3, sum(r.pool_bytes for r in captured))
        )
        prompts, limits = loads[w]
        share = list(range(replica, len(prompts), replicas))  # dsaflow.serve.replicas.replica_share's rule
        # warm-up: first calls allocate and compile; prompts across the workload's lengths, so the timed run
        # meets no new kernel specialisation
        ranked = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        picks = sorted({ranked[(len(ranked) - 1) * q // 7] for q in range(8)})
        eng.generate([prompts[i] for i in picks], [2] * len(picks))
        timer = PassTimer(eng) if args.profile_passes else None
        captures_before = eng.transfers.captures if eng.transfers is not None else 0
        kinds.update(dict.fromkeys(kinds, 0))  # count the timed run's passes only
        if replicas > 1:
            import torch.distributed as dist

            dist.barrier()  # the replicas start together: the row's wall time is the slowest replica's
        with Heartbeat(label) if loud else contextlib.nullcontext():
            t0 = time.perf_counter()
            arrivals = arrival_times(args, len(share)) if args.arrival_rate else None
            out = eng.generate(
                [prompts[i] for i in share], [limits[i] for i in share], key_ids=share, arrivals=arrivals
            )
            wall = time.perf_counter() - t0
        st = eng.stats
        # per global rank: (tokens, wall s, TTFTs, TPOTs); latencies are known on each replica's last stage only
        mine = gather((st["tokens"], wall, list(st["ttft_s"].values()), list(st["tpot_s"].values())))
        last_ranks = [d * RANKS[base] + RANKS[base] - 1 for d in range(replicas)]
        per_replica = [mine[g] for g in last_ranks] if not every_rank else [mine[0]]
        if args.trace:
            name = f"trace-{pipeline}-g{eng.groups}-{w}-{'continuous' if continuous else 'fixed'}"
            name += f"-mixed{budget}-graphs{mixed_graphs}-rank{rank}" if budget else f"-rank{rank}"
            write_trace(eng, prompts[:64], limits[:64], Path(args.out) / f"{name}.json.gz")
        busy = gather(
            (
                st["busy_fraction"],
                st["decode_busy"],
                st["decode_host_ms_per_tick"],
                st["decode_lead_p50_ms"],
                st["decode_host_late"],
                # graphs.transfers: (signatures captured in all, of them during the timed run, replays, eager ticks)
                None
                if eng.transfers is None
                else (
                    eng.transfers.captures,
                    eng.transfers.captures - captures_before,
                    eng.transfers.replays,
                    eng.transfers.eager_ticks,
                ),
                st["busy_after_prefill"],
                st["mixed_busy"],
            )
        )
        if (out is not None and replica == 0) or every_rank:
            tokens = sum(t for t, _, _, _ in per_replica)
            wall = max(w_s for _, w_s, _, _ in per_replica)
            ttft = [x for _, _, values, _ in per_replica for x in values]
            tpot = [x for _, _, _, values in per_replica for x in values]
            rows.append(
                {
                    "pipeline": pipeline,
                    "ranks": RANKS[base],
                    "replicas": replicas,
                    "replica_tokens_per_s": [t / w_s for t, w_s, _, _ in per_replica],
                    "microbatches": eng.groups,
                    "microbatches_setting": "default" if mb is None else mb,
                    "workload": w,
                    "batching": "continuous" if continuous else "fixed",
                    "max_pass_tokens": budget,  # None: a pass prefills or decodes; else mixed passes of this budget
                    "mixed_pass_share": kinds["mixed"] / max(1, sum(kinds.values())),
                    "mixed_graphs": mixed_graphs,  # with a budget: on = mixed passes replayed from graphs, off = eager
                    "requests": len(prompts),
                    "output_tokens": tokens,
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall,
                    "ttft_p50_s": pct(ttft, 0.5),
                    "ttft_p99_s": pct(ttft, 0.99),
                    "tpot_p50_s": pct(tpot, 0.5),
                    "tpot_p99_s": pct(tpot, 0.99),
                    "busy_fraction": [b[0] for b in busy],
                    "decode_busy_fraction": [b[1] for b in busy],
                    # per rank: host ms per decode tick by phase (pick, stage, exchange, feedback); on GPU the median
                    # time a decode pass queued before the GPU ran it, and the share it did not (the host was late)
                    "decode_host_ms_per_tick": [b[2] for b in busy],
                    "decode_lead_p50_ms": [b[3] for b in busy],
                    "decode_host_late": [b[4] for b in busy],
                    # per rank with graphs.transfers: [captured, captured in the timed run, replays, eager ticks]
                    "transfer_graphs": [b[5] for b in busy],
                    # per rank: busy fraction in the 1st .. (ranks-1)th tick after a prefill pass left the pipeline
                    # (not decode ticks, though every pass in flight decodes: the ranks wait out the prefill)
                    "busy_after_prefill": [b[6] for b in busy],
                    # per rank: busy fraction of the ticks with a mixed pass in flight; the ticks by kind, and the
                    # run as (start s, end s, kind) segments of consecutive ticks of one kind (the figure's timeline)
                    "mixed_busy_fraction": [b[7] for b in busy],
                    "tick_kinds": st["tick_kinds"],
                    "tick_segments": coarse_segments(st["tick_segments"]),
                    "ticks": st["ticks"],
                    "graphs": args.graphs,
                    # per rank: graphs captured at setup, their capture time and the graph pools' growth
                    "graphs_captured": [c[0] for c in capture],
                    "capture_s": [c[1] for c in capture],
                    "graph_pool_gib": [c[2] / 2**30 for c in capture],
                    "device": str(device),
                }
            )
            if timer is not None:
                rows[-1]["pass_profile"] = timer.summary()
                print(f"  GPU time per pass kind: {rows[-1]['pass_profile']}", flush=True)
            r = rows[-1]
            keep_row(args, r)
            print(
                f"{pipeline} groups={r['microbatches']} {w} {r['batching']} budget {budget or '-'}"
                + (f" mixed graphs {mixed_graphs}: " if budget else ": ")
                + f"{r['tokens_per_s']:.1f} tokens/s"
                + (
                    f" ({', '.join(f'{x:.1f}' for x in r['replica_tokens_per_s'])} per replica), "
                    if replicas > 1
                    else ", "
                )
                + f"mixed passes {r['mixed_pass_share']:.2f}, "
                f"TTFT p50 {r['ttft_p50_s'] or 0:.3f} s p99 {r['ttft_p99_s'] or 0:.3f} s, "
                f"TPOT p50 {(r['tpot_p50_s'] or 0) * 1e3:.2f} ms p99 {(r['tpot_p99_s'] or 0) * 1e3:.2f} ms, "
                f"busy {[round(b, 2) for b in r['busy_fraction']]}, decode busy "
                f"{[round(b, 2) for b in r['decode_busy_fraction']]}, {host_line(r)}, graphs {r['graphs_captured']} "
                "captured in "
                f"{[round(c, 1) for c in r['capture_s']]} s, pools {[round(g, 2) for g in r['graph_pool_gib']]} GiB"
                + (f", transfer graphs {r['transfer_graphs']}" if any(r["transfer_graphs"]) else ""),
                flush=True,
            )
        del eng
        gc.collect()  # free its graphs and caches now (reference cycles hold them), before the next engine captures
    return rows


def worker(args) -> None:
    """One pipeline rank under torchrun: NCCL on GPUs, gloo on CPU."""
    import torch.distributed as dist

    from dsaflow.pipeline.p2p import torchrun_rank

    with torchrun_rank(args.device, args.threads if args.device == "cpu" else None) as (device, link):

        def gather(x):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, x)
            return out

        rows = measure(args, args.pipeline, dist.get_rank(), device, link, gather)
        if rows:
            write_rank_rows(args.rows_file, rows)


def run_pipeline(args, pipeline: str) -> list:
    """One ppN split as N processes (torchrun) -> the last stage's rows."""
    passed = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in (
            "device",
            "workloads",
            "model",
            "overrides",
            "requests",
            "max_batch",
            "prefill_chunk",
            "mixed_prompt",
            "mixed_new",
            "uniform_prompt",
            "uniform_new",
            "graphs",
            "threads",
            "max_pass_tokens",
            "mixed_graphs",
            "seed",
            "out",
        )
    ]
    passed += ["--trace"] * args.trace
    argv = ["engine", *passed, "--worker", f"--pipeline={pipeline}"]
    return rows_from_ranks(ENTRY, argv, processes(pipeline), args.threads if args.device == "cpu" else None)


def main(argv=None, prog: str = PROG) -> int:
    args = parse_args(argv, prog)
    if args.worker:
        worker(args)
        return 0
    threads = torch.get_num_threads()
    try:
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        return run_all(args, argv, prog)
    finally:
        torch.set_num_threads(threads)


def run_all(args, argv, prog: str) -> int:
    device = torch.device(args.device)
    pipelines = args.pipelines.split(",")
    for p in pipelines:
        if split_of(p) is None:
            user_error(prog, f"--pipelines: {p!r} is not one of {', '.join(RANKS)}, or ppNxR (e.g. pp2x2)")
        if split_of(p)[1] > args.requests:
            user_error(prog, f"--pipelines: {p} has {split_of(p)[1]} replicas for --requests {args.requests}: each "
                       f"replica needs a request. Fix: --requests {split_of(p)[1]} or more.")  # fmt: skip
    out = out_dir(prog, args.out)
    args.out = str(out)  # the ranks of a ppN split write their traces there too
    total = sum(len(runs_of(args, p)) for p in pipelines)
    print(f"{prog}: {total} configurations ({', '.join(f'{p}: {len(runs_of(args, p))}' for p in pipelines)}), "
          f"{args.requests} requests each on {args.device}; a line per configuration as it starts", flush=True)  # fmt: skip
    rows, skipped = [], []
    partial_path(args).unlink(missing_ok=True)
    load_before = os.getloadavg()[0]
    for p in pipelines:
        n_gpu = torch.cuda.device_count() if args.device == "cuda" else 0
        if args.device == "cuda" and processes(p) > n_gpu:
            skipped.append(f"{p} needs {processes(p)} GPUs, this machine has {n_gpu} (not run on a shared GPU)")
            print(f"skipped: {skipped[-1]}", flush=True)
            continue
        if p == "single":
            rows += measure(args, p, 0, device, None, lambda x: [x])
        else:
            rows += run_pipeline(args, p)
    cks = checks(rows)
    env = {
        **environment(device),
        "device": args.device,
        "model": args.model,
        "overrides": args.overrides,
        "graphs": args.graphs,
        "max_batch": args.max_batch,
        "requests": args.requests,
        "mixed_prompt": args.mixed_prompt,
        "mixed_new": args.mixed_new,
        "uniform_prompt": args.uniform_prompt,
        "uniform_new": args.uniform_new,
        "prefill_chunk": args.prefill_chunk,
        "threads": args.threads,
        "max_pass_tokens": args.max_pass_tokens,
        "mixed_graphs": args.mixed_graphs,
        "arrival_rate": args.arrival_rate,
        "skipped": skipped,
        # other processes on the machine: pp ranks compute at once, so a busy machine slows them most
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "command": command_line(prog, argv),
    }
    data = {"env": env, "rows": rows, "checks": cks}
    write_results(out, "bench_serve", data, markdown(rows, env, cks), (lambda plt: plot(rows, plt)) if rows else None)
    partial_path(args).unlink(missing_ok=True)
    return 0
