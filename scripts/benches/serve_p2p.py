"""The per-tick cost of the pipeline schedule's transfers on 2 GPUs, apart from any model.

    python scripts/bench_serve.py p2p --out bench_out/p2p

Two NCCL ranks (torchrun, one GPU each) walk the tick loop of a two-group, two-stage decode
(dsaflow/pipeline/ticks.py): in every tick each GPU runs a compute span of fixed length (a spin kernel, standing in
for a stage's decode pass), then one batch of point-to-point ops moves rank 0's activation ([rows, 1, dim] bf16)
to rank 1 and rank 1's feedback ([2, rows] int64: sampled tokens, EOS flags) to rank 0, and the next span reads
what arrived. So every tick depends on the partner's previous one, as with as many groups as ranks.

Per compute length and way of posting the ops it reports:
- busy: compute time / wall time on each GPU (the ceiling of the serving benchmark's decode busy fraction at that
  pass length, with no host work but the transfers);
- gap_ms: (wall - compute) per tick, the GPU time a tick loses to the hop;
- host_us: host microseconds per tick spent posting and waiting on the ops (never blocking on the GPU).

Ways of posting (`--modes`), each through `StageLink.exchange`: `batch` with torch.distributed.batch_isend_irecv,
`group` on the process group inside one coalescing block, without batch_isend_irecv's Python checks (what the
engine uses with NCCL), and `graph`: the whole tick (the span and the coalescing block) captured once as a CUDA
graph and replayed, the host's cost of a tick that never leaves the GPU (busy there is the spin's known length over
the tick, since a timing event cannot be recorded inside a graph; a capture that fails is reported as its error).
Writes <out>/bench_p2p.json and bench_p2p.md. Needs 2 GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_lib import command_line, describe_device, launch_ranks, need_cuda, out_dir, write_results

from dsaflow.pipeline.p2p import StageLink, torchrun_rank

ENTRY = Path(__file__).resolve().parents[1] / "bench_serve.py"  # what torchrun starts on every rank
PROG = "bench_serve.py p2p"


def parse_args(argv=None, prog: str = PROG):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="rows of one group's pass")
    ap.add_argument("--dim", type=int, default=512, help="hidden size of the activation sent")
    ap.add_argument("--compute-ms", default="0,0.2,0.7", help="comma separated span lengths per tick")
    ap.add_argument("--modes", default="batch,group,graph")
    ap.add_argument("--ticks", type=int, default=2000)
    ap.add_argument("--out", default="bench_out/p2p")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def spin_cycles_per_ms(device) -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond on this GPU."""
    n = 20_000_000
    torch.cuda._sleep(n // 10)  # warm-up
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(n)
    b.record()
    torch.cuda.synchronize(device)
    return n / a.elapsed_time(b)


def run_case(device, rank: int, mode: str, compute_ms: float, cycles_ms: float, args) -> dict:
    # the same values on both ranks, so that each can check what it received (`delivered`)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, 1, args.dim, device=device, generator=gen).to(torch.bfloat16)
    feedback = torch.randint(0, 256, (2, args.rows), device=device, generator=gen)
    got_hidden = torch.empty_like(hidden)
    got_feedback = torch.empty_like(feedback)
    sink = torch.zeros((), device=device)
    if rank == 0:
        ops = [("send", hidden, 1), ("recv", got_feedback, 1)]
    else:
        ops = [("recv", got_hidden, 0), ("send", feedback, 0)]
    cycles = int(compute_ms * cycles_ms)
    post = StageLink(device, coalesce=mode != "batch").exchange

    def tick(spans, host):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        if cycles:
            torch.cuda._sleep(cycles)
        sink.add_(got_feedback[0, 0] if rank == 0 else got_hidden[0, 0, 0].float())  # consume the last receive
        b.record()
        spans.append((a, b))
        h = time.perf_counter()
        post(ops)
        host.append(time.perf_counter() - h)

    for _ in range(100):
        tick([], [])
    torch.cuda.synchronize(device)
    if mode == "graph":
        return run_graph_case(device, rank, ops, cycles, compute_ms, sink, args, (hidden, feedback))
    spans = []
    host = []
    wall = timed_ticks(device, args.ticks, lambda: tick(spans, host))
    busy = sum(a.elapsed_time(b) for a, b in spans)
    return {
        "delivered": delivered(rank, hidden, feedback, got_hidden, got_feedback),
        "mode": mode,
        "compute_ms": compute_ms,
        **tick_stats(busy, wall, host, args.ticks),
    }


def timed_ticks(device, ticks: int, tick) -> float:
    """Run `tick()` `ticks` times between two CUDA events -> GPU wall ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ticks):
        tick()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def tick_stats(busy_ms: float, wall_ms: float, host_s: list, ticks: int) -> dict:
    """The reported fields of one case, from its compute ms, wall ms and host seconds per tick."""
    host_s = sorted(host_s)
    return {
        "busy": min(1.0, busy_ms / wall_ms),
        "gap_ms": (wall_ms - busy_ms) / ticks,
        "tick_ms": wall_ms / ticks,
        "host_us_p50": host_s[len(host_s) // 2] * 1e6,
        "host_us_mean": sum(host_s) / len(host_s) * 1e6,
    }


def delivered(rank: int, hidden, feedback, got_hidden, got_feedback) -> bool:
    """Whether this rank's receive buffer holds what its partner sent (both ranks made the same tensors)."""
    return bool(torch.equal(got_feedback, feedback) if rank == 0 else torch.equal(got_hidden, hidden))


def run_graph_case(device, rank: int, ops, cycles: int, compute_ms: float, sink, args, sent) -> dict:
    """The tick of `run_case` captured as one CUDA graph (span, consume, coalesced transfers), then replayed. The
    receive buffers are zeroed after capture, so `delivered` proves the replays moved the data."""
    link = StageLink(device, coalesce=True)
    row = {"mode": "graph", "compute_ms": compute_ms}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            if cycles:
                torch.cuda._sleep(cycles)
            sink.add_(ops[1][1][0, 0] if rank == 0 else ops[0][1][0, 0, 0].float())
            link.exchange(ops)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - whether capture works is what this case finds out
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    import torch.distributed as dist

    both_captured = torch.tensor([0 if "error" in row else 1], device=device)
    dist.all_reduce(both_captured, op=dist.ReduceOp.MIN)  # a replay without its partner's would wait forever
    if not int(both_captured.item()):
        return {**row, "error": row.get("error", "the partner's capture failed")}
    received = ops[1][1] if rank == 0 else ops[0][1]
    received.zero_()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize(device)
    host = []

    def replay():
        h = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - h)

    wall = timed_ticks(device, args.ticks, replay)
    hidden, feedback = sent
    return {
        **row,
        "delivered": delivered(rank, hidden, feedback, received, received),
        **tick_stats(compute_ms * args.ticks, wall, host, args.ticks),
    }


def worker(args) -> None:
    import torch.distributed as dist

    with torchrun_rank("cuda") as (device, _):
        rank = dist.get_rank()
        cycles_ms = spin_cycles_per_ms(device)
        rows = []
        for mode in args.modes.split(","):
            for c in (float(x) for x in args.compute_ms.split(",")):
                row = run_case(device, rank, mode, c, cycles_ms, args)
                both = [None, None]
                dist.all_gather_object(both, row)
                if rank == 0 and any("error" in r for r in both):
                    print(f"{mode} compute {c} ms: {[r.get('error') for r in both]}", flush=True)
                    rows.append({**both[0], "error": [r.get("error") for r in both]})
                elif rank == 0:
                    merged = dict(both[0])
                    for k in ("delivered", "busy", "gap_ms", "tick_ms", "host_us_p50", "host_us_mean"):
                        merged[k] = [r[k] for r in both]
                    rows.append(merged)
                    print(
                        f"{mode} compute {c} ms: busy {[round(b, 3) for b in merged['busy']]}, gap ms per tick "
                        f"{[round(g, 4) for g in merged['gap_ms']]}, host us per tick (p50) "
                        f"{[round(h, 1) for h in merged['host_us_p50']]}",
                        flush=True,
                    )
        if rank == 0:
            env = {
                "torch": torch.__version__,
                "gpu": describe_device(device),
                "rows": args.rows,
                "dim": args.dim,
                "ticks": args.ticks,
            }
            cmd = command_line(PROG, [a for a in args.argv if a != "--worker"])
            lines = [
                f"{env['gpu']} x2, torch {env['torch']}, activation [{args.rows}, 1, {args.dim}] bf16 one way and "
                f"[2, {args.rows}] int64 the other, {args.ticks} ticks. Command: `{cmd}`.",
                "",
                "| posting | compute ms per tick | busy per GPU | gap ms per tick | host us per tick (p50) | delivered |",
                "|---|---:|---|---|---|---|",
            ]
            for r in rows:
                if "error" in r:
                    lines.append(f"| {r['mode']} | {r['compute_ms']} | failed: {r['error']} | | | |")
                    continue
                lines.append(
                    f"| {r['mode']} | {r['compute_ms']} | {', '.join(f'{b:.3f}' for b in r['busy'])} | "
                    f"{', '.join(f'{g:.4f}' for g in r['gap_ms'])} | {', '.join(f'{h:.0f}' for h in r['host_us_p50'])} | "
                    f"{'yes' if all(r['delivered']) else 'NO'} |"
                )
            write_results(args.out, "bench_p2p", {"env": env, "rows": rows}, "\n".join(lines))


def main(argv=None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog)
    args.argv = argv
    if args.worker:
        worker(args)
        return 0
    need_cuda(prog, gpus=2, why="one NCCL rank each")
    out_dir(prog, args.out)  # the ranks start in this folder: a relative --out is the same folder there
    return launch_ranks(ENTRY, ["p2p", *argv, "--worker"], 2)
