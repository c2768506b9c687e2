"""What the kernel benchmarks share (`bench_ops.py`, `bench_peers.py`): DeepSeek-V3.2 attention shapes, timing,
the rows every section appends to, and the device's matmul and copy ceilings that each row is a fraction of."""

from __future__ import annotations

import json

import torch
import triton
import triton.testing

H, D_QK, D_V, TOPK = 128, 576, 512, 2048
ROWS: list[dict] = []  # every timed row of the run, in order
CEIL: dict = {}  # measured by `measure_ceilings` before any row


def bench(fn, rep_ms=200, warmup_ms=50) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def timed_slow(fn, n=3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def add_rates(row: dict, ms: float, ceil: dict, flops=None, nbytes=None) -> dict:
    """A row timed at `ms` gains its TFLOP/s (given flops) and TB/s (given bytes), each also as a fraction of the
    ceilings in `ceil` (`matmul_tflops`, `copy_tbps`)."""
    if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
        row["frac_matmul"] = round(row["tflops"] / ceil["matmul_tflops"], 3)
    if nbytes:
        row["tbps"] = round(nbytes / ms / 1e9, 3)
        row["frac_copy"] = round(row["tbps"] / ceil["copy_tbps"], 3)
    return row


def record(kernel, impl, ctx, ms, flops=None, nbytes=None, **extra):
    row = dict(kernel=kernel, impl=impl, context=ctx, time_ms=round(ms, 4), flops=flops, bytes=nbytes, **extra)
    add_rates(row, ms, CEIL, flops, nbytes)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def measure_ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, rep_ms=300)
    CEIL["matmul_tflops"] = round(2 * 8192**3 / ms / 1e9, 1)
    x = torch.randn(2**29 // 2, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep_ms=300)
    CEIL["copy_tbps"] = round(2 * x.numel() * 2 / ms / 1e9, 3)
    print("ceilings", CEIL, flush=True)


def mla_inputs(ctx, n_q, h=H, batch=1, t_per_seq=None, seed=0):
    """Queries at the end of a ctx-token context; each selects TOPK random visible rows (all valid)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = t_per_seq or n_q
    q = torch.randn(batch, T, h, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(batch, ctx, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(ctx - T, ctx, device="cuda").view(1, T, 1)
    idx = (torch.rand(batch, T, TOPK, device="cuda", generator=g) * (pos + 1)).to(torch.int32)
    return q, kv, idx


def sweep(name, make_fn, configs):
    best = None
    for cfg in configs:
        try:
            ms = bench(make_fn(cfg), rep_ms=150)
        except Exception as e:  # a config that does not compile (shared memory, registers) is reported, not fatal
            print(f"sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        print(f"sweep {name} {cfg}: {ms:.3f} ms", flush=True)
        ROWS.append(dict(kernel=name, impl="sweep", config=cfg, time_ms=round(ms, 4)))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best[0] if best else None


def rel_err(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()
