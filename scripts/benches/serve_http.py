"""`bench_serve.py http`: `dsaflow serve` driven over HTTP by the official `openai` client, beside the in-process
engine on the same workload in the same call, with the metric names of vLLM's `benchmark_serving`.

    python scripts/bench_serve.py http --device cpu --requests 64 --rate 8 --out bench_out/http
    python scripts/bench_serve.py http --device cuda --requests 2000 --rate 120 model=small graphs=decode_mixed \
        serve.max_pass_tokens=512 serve.max_batch=64

The workload: `--requests` prompts of `--input-len` random token ids, each asking `--output-len` tokens, greedy
(no EOS, so every request generates all of them). Requests arrive as a Poisson process of `--rate` per second, or,
with `--concurrency C`, C clients send back to back (rate and concurrency: vLLM's `--request-rate` and
`--max-concurrency`). The engine row serves the same prompts in this process through `PipelineEngine.generate`
(every stage here; with --rate the same arrival times, with --concurrency all at once, its saturation), the http row
through a server this command starts (`dsaflow serve server.port=0` plus the overrides) or the one at --url.

Per row: completed, total_input_tokens, total_output_tokens, duration, request_throughput, output_throughput,
total_token_throughput, and mean / median / p99 of ttft_ms, tpot_ms, itl_ms (the http row; inter-token latency is
the gap between stream chunks) and e2el_ms. Writes bench_http.json and bench_http.md (the two rows and their ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench_lib import environment, out_dir, resolve_device, write_results

PROG = "bench_serve.py http"
REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="requests per second, Poisson (default: all at once)")
    ap.add_argument("--concurrency", type=int, default=None, help="clients sending back to back (instead of --rate)")
    ap.add_argument("--url", default=None, help="a running dsaflow serve (default: start one with the overrides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/http")
    ap.add_argument("overrides", nargs="*", help="config overrides for the engine and the server (key=value)")
    a = ap.parse_args(argv)
    a.device = resolve_device(PROG, a.device)
    if a.rate is not None and a.concurrency is not None:
        ap.error("give --rate or --concurrency, not both")
    return a


def workload(a, vocab: int):
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.requests)]
    t, arrivals = 0.0, []
    for _ in prompts:
        t += rng.expovariate(a.rate) if a.rate else 0.0
        arrivals.append(t)
    return prompts, arrivals


def percentiles(name: str, values_s: list) -> dict:
    import statistics

    ms = sorted(v * 1e3 for v in values_s) or [float("nan")]
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms), f"p99_{name}_ms": p99}


def summary(n_in: int, outputs: list, duration: float, ttft: list, tpot: list, itl: list, e2el: list) -> dict:
    out = sum(outputs)
    row = {
        "completed": len(outputs),
        "total_input_tokens": n_in,
        "total_output_tokens": out,
        "duration": duration,
        "request_throughput": len(outputs) / duration,
        "output_throughput": out / duration,
        "total_token_throughput": (n_in + out) / duration,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        row.update(percentiles(name, vals))
    return row


def engine_row(a, cfg, prompts, arrivals) -> dict:
    """The same requests through `PipelineEngine.generate` in this process (every stage here)."""
    from dsaflow.plan import build_plan
    from dsaflow.serve.generate import build_engine

    if a.device == "cpu":  # as a worker does (dsaflow.pipeline.run_context)
        import torch

        torch.set_num_threads(max(1, int(cfg.train.cpu_threads)))
    eng = build_engine(cfg, build_plan(cfg), 0, a.device, all_stages=True)
    eng.capture()
    limits = [a.output_len] * len(prompts)
    eng.generate(prompts[:2], limits[:2])  # warm-up
    t0 = time.perf_counter()
    out = eng.generate(prompts, limits, arrivals=arrivals if a.rate else None)
    duration = time.perf_counter() - t0
    st = eng.stats
    del eng  # its caches and graphs leave the device before the server's workers take it
    if a.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    ttft = list(st["ttft_s"].values())
    tpot = [v for v in st["tpot_s"].values() if v is not None]
    e2el = [ttft[i] + (tpot[i] if i < len(tpot) else 0) * (len(o) - 1) for i, o in enumerate(out)]
    return summary(sum(map(len, prompts)), [len(o) for o in out], duration, ttft, tpot, [], e2el)


async def one_request(client, model: str, prompt, a, record: list) -> None:
    start = time.perf_counter()
    chunks, usage = [], None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=a.output_len,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for c in stream:
        if c.usage is not None:
            usage = c.usage
        if c.choices:
            chunks.append(time.perf_counter())
    end = time.perf_counter()
    n = usage.completion_tokens if usage else len(chunks)
    record.append((start, chunks, end, n))


async def drive(a, url: str, model: str, prompts, arrivals) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=url + "/v1", api_key=os.environ.get("DSAFLOW_API_KEY", "none"), max_retries=0, timeout=3600
    )
    record: list = []
    await one_request(client, model, prompts[0], a, [])  # warm-up
    t0 = time.perf_counter()
    if a.concurrency:
        queue = list(prompts)

        async def worker():
            while queue:
                await one_request(client, model, queue.pop(0), a, record)

        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    else:

        async def at(t, p):
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))
            await one_request(client, model, p, a, record)

        await asyncio.gather(*(at(t, p) for t, p in zip(arrivals, prompts)))
    duration = time.perf_counter() - t0
    ttft = [c[0] - s for s, c, _, _ in record if c]
    tpot = [(e - c[0]) / (n - 1) for s, c, e, n in record if c and n > 1]
    itl = [b - x for _, c, _, _ in record for x, b in zip(c, c[1:])]
    e2el = [e - s for s, _, e, _ in record]
    return summary(sum(map(len, prompts)), [n for *_, n in record], duration, ttft, tpot, itl, e2el)


def start_server(a, log: Path):
    cmd = [
        sys.executable,
        "-c",
        "from dsaflow.cli import main; main()",
        "serve",
        "server.port=0",
        "track=none",
        f"train.device={a.device}",
        *a.overrides,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while not (m := re.search(r"ready on (http://\S+)", log.read_text())):
        if proc.poll() is not None:
            sys.exit(f"{PROG}: the server exited (status {proc.returncode}); see {log}")
        time.sleep(0.2)
    return proc, m.group(1)


def markdown(rows: dict, a) -> str:
    keys = [
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "p99_itl_ms",
    ]
    load = f"rate {a.rate}/s" if a.rate else f"concurrency {a.concurrency}" if a.concurrency else "all at once"
    lines = [
        f"{a.requests} requests x {a.input_len} prompt + {a.output_len} output tokens, {load}",
        "",
        "| row | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.2f}" if r[k] == r[k] else "-" for k in keys) + " |")
    e, h = rows["engine"], rows["http"]
    lines += [
        "",
        f"http / engine output_throughput: {h['output_throughput'] / e['output_throughput']:.3f}; "
        f"p99_ttft_ms difference: {h['p99_ttft_ms'] - e['p99_ttft_ms']:+.2f} ms",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str = PROG) -> int:
    from dsaflow.config.compose import compose

    a = parse_args(argv)
    out = out_dir(prog, a.out)
    cfg = compose(["mode=serve", "track=none", f"train.device={a.device}", *a.overrides])
    prompts, arrivals = workload(a, cfg.model.vocab_size)
    rows = {"engine": engine_row(a, cfg, prompts, arrivals)}
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(a, out / "server.log")
    try:
        model = cfg.server.model_name or cfg.model.name
        rows["http"] = asyncio.run(drive(a, url, model, prompts, arrivals))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    data = {"environment": environment(a.device), "args": vars(a), "rows": rows}
    write_results(out, "bench_http", data, markdown(rows, a))
    return 0
