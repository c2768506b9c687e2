"""`bench_fp8.py --sweep`: time the FP8 GEMMs' candidate tile configs (dsaflow/ops/fp8_gemm/tile_configs.py,
DENSE_CANDIDATES and GROUPED_CANDIDATES) per bucket at DeepSeek-V3.2 shapes, in one GPU call of a few minutes, and
write the winners as rows of DENSE_TABLE / GROUPED_TABLE, ready to paste.

Dense buckets (few rows, decode): each candidate runs `fp8_linear_triton` (the activations' quantization included,
or fused where the candidate says so) on the four dense weights of bench_fp8.py, replayed from a CUDA graph (what a
serving step pays: launches captured); a bucket's winner has the least total time over the four, and each shape's
own winner is listed too. Grouped buckets (256 experts, 8 per token): each candidate runs `fp8_grouped_mm_triton` on
the experts' gate_up and down (random fp8 weights: the timing does not depend on the values), least total time wins.
The table's current config and, for dense bf16, torch's scaled_mm row are timed beside them, and in each grouped
bucket the Gluon kernel (`gluon_fp8_grouped.py`: the next K block's MMA overlapped with the last one's scaling) where
its rule takes the call (sm_90): baselines, never a table row. A candidate that fails to compile or run is reported and
skipped. Writes bench_fp8_sweep.json and .md to --out.
"""

from __future__ import annotations

import os
import time

import torch
from bench_lib import CEIL, bench, bench_graph, environment, fp8_ceiling, measure_ceilings, write_results

DENSE = {"q_b": (24576, 1536), "o_proj": (7168, 16384), "shared gate_up": (4096, 7168), "shared down": (7168, 2048)}
GROUPED = {"experts gate_up": (4096, 7168), "experts down": (7168, 2048)}
EXPERTS, TOP_K = 256, 8
DECODE_ROWS_PER_EXPERT = 16  # grouped buckets up to this many rows per expert are rated against the copy rate
GLUON = "gluon 128x128 overlap"  # the Gluon grouped kernel's baseline row
BASELINES = ("table now", GLUON)


def _time(fn, graph: bool) -> tuple[float | None, str | None]:
    """(median ms, None), or (None, the error's first line) where the launch fails (e.g. out of shared memory)."""
    try:
        fn()  # compiles outside the timing and the capture
        torch.cuda.synchronize()
        return (bench_graph(fn) if graph else bench(fn, rep_ms=100)), None
    except Exception as exc:  # noqa: BLE001 - a failed candidate is a result of the sweep, not a crash
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def sweep_dense(results: list) -> None:
    from dsaflow.ops.fp8_gemm import quantize_blocks_128, tile_configs
    from dsaflow.ops.fp8_gemm.torch_blockwise import torch_support_reason
    from dsaflow.ops.fp8_gemm.triton_fp8_gemm import fp8_linear_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        op: quantize_blocks_128(torch.randn(N, K, device="cuda", generator=g) * 0.02) for op, (N, K) in DENSE.items()
    }
    torch_ok = torch_support_reason() is None and torch.cuda.get_device_capability() == (9, 0)
    for bound, M, candidates in tile_configs.DENSE_CANDIDATES:
        xs = {op: torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16) for op, (N, K) in DENSE.items()}
        table = {op: tile_configs.dense_config(M, N) for op, (N, K) in DENSE.items()}
        entries = [(c.name(), c) for c in candidates] + [("table now", None)]
        for label, config in entries:
            row = {
                "kernel": "dense",
                "bound": bound,
                "timed_at": M,
                "config": label,
                "fields": _fields(config),
                "ms": {},
            }
            for op, (w8, w_scale) in weights.items():
                cfg = config or table[op]
                row["ms"][op], err = _time(lambda: fp8_linear_triton(xs[op], w8, w_scale, False, cfg), graph=True)
                if err:
                    row["error"] = err
                    break
            results.append(row)
            print(f"dense M={M} {label}: {row['ms']} {row.get('error', '')}", flush=True)
        if torch_ok:
            from dsaflow.ops.fp8_gemm import fp8_linear

            os.environ["DSAFLOW_FP8_GEMM"] = "torch_scaled_mm"
            row = {"kernel": "dense", "bound": bound, "timed_at": M, "config": "torch scaled_mm", "fields": None}
            row["ms"] = {op: _time(lambda: fp8_linear(xs[op], *weights[op]), graph=True)[0] for op in DENSE}
            os.environ.pop("DSAFLOW_FP8_GEMM")
            results.append(row)
    del weights


def random_experts(N: int, K: int, g):
    """fp8 [E, N, K] expert weights drawn 16 experts at a time, and scales near a real checkpoint's."""
    w8 = torch.empty(EXPERTS, N, K, device="cuda", dtype=torch.float8_e4m3fn)
    for e in range(0, EXPERTS, 16):
        w8[e : e + 16] = (torch.randn(16, N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 64).to(w8.dtype)
    w_scale = torch.rand(EXPERTS, -(-N // 128), -(-K // 128), device="cuda", generator=g) * 1e-4
    return w8, w_scale


def sweep_grouped(results: list) -> None:
    from dsaflow.ops.fp8_gemm import tile_configs
    from dsaflow.ops.fp8_gemm.gluon_fp8_grouped import fp8_grouped_mm_gluon, gluon_support_reason
    from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton
    from dsaflow.ops.fp8_gemm.triton_fp8_grouped import fp8_grouped_mm_triton
    from dsaflow.ops.moe import sort_by_expert

    g = torch.Generator(device="cuda").manual_seed(1)
    rows = {}
    for op, (N, K) in GROUPED.items():
        w8, w_scale = random_experts(N, K, g)
        for bound, per_expert, candidates in tile_configs.GROUPED_CANDIDATES:
            M = per_expert * EXPERTS
            ids = torch.rand(M // TOP_K, EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
            _, offsets = sort_by_expert(ids, EXPERTS)
            picked = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())  # experts with a row
            x8, x_scale_t = quantize_rows_1x128_triton(
                torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            )
            entries = [(c.name(), c) for c in candidates] + [("table now", tile_configs.grouped_config(M, EXPERTS, N))]
            if gluon_support_reason(x8, w8) is None:
                entries.append((GLUON, None))
            for label, config in entries:
                key = (bound, label)
                row = rows.setdefault(key, {"kernel": "grouped", "bound": bound, "timed_at": M, "config": label,
                                            "fields": _fields(config) if label not in BASELINES else None, "ms": {},
                                            "weight_bytes": {}})  # fmt: skip
                row["weight_bytes"][op] = picked * N * K
                if label == GLUON:
                    fn = lambda: fp8_grouped_mm_gluon(x8, x_scale_t, w8, w_scale, offsets, M, torch.bfloat16)  # noqa: E731
                else:
                    fn = lambda: fp8_grouped_mm_triton(x8, x_scale_t, w8, w_scale, offsets, M, torch.bfloat16, config)  # noqa: E731
                row["ms"][op], err = _time(fn, graph=False)
                if err:
                    row["error"] = err
                print(f"grouped {op} M={M} {label}: {row['ms'][op]} {err or ''}", flush=True)
            del x8, x_scale_t
        del w8, w_scale
        torch.cuda.empty_cache()
    results += rows.values()


def _fields(config) -> dict | None:
    from dataclasses import asdict

    return asdict(config) if config is not None else None


def rates(row: dict) -> None:
    """Adds each shape's TFLOP/s as a fraction of the fp8 ceiling (grouped) or its weight bytes per second as a
    fraction of the copy rate (dense: decode reads the weight once), and the total ms."""
    shapes = DENSE if row["kernel"] == "dense" else GROUPED
    M = row["timed_at"]
    row["of_bound"] = {}
    for op, ms in row["ms"].items():
        if ms is None:
            continue
        N, K = shapes[op]
        if row["kernel"] == "dense":
            row["of_bound"][op] = round(N * K / ms / 1e9 / CEIL["copy_tbps"], 3)
        elif M // EXPERTS <= DECODE_ROWS_PER_EXPERT:  # decode: the experts' weight bytes bound it
            row["of_bound"][op] = round(row["weight_bytes"][op] / ms / 1e9 / CEIL["copy_tbps"], 3)
        else:
            row["of_bound"][op] = round(2 * M * N * K / ms / 1e9 / CEIL["fp8_tflops"], 3)
    complete = len(row["ms"]) == len(shapes) and None not in row["ms"].values() and "error" not in row
    row["total_ms"] = round(sum(row["ms"].values()), 5) if complete else None


def winners(results: list) -> dict:
    """{(kernel, bound): the best candidate row by total ms} over the candidates (not the baselines)."""
    best = {}
    for r in results:
        if r["fields"] is None or r["total_ms"] is None:
            continue
        key = (r["kernel"], r["bound"])
        if key not in best or r["total_ms"] < best[key]["total_ms"]:
            best[key] = r
    return best


def table_rows(kernel: str, best: dict) -> list[str]:
    """The kernel's table with each swept bucket's row replaced by its winner, as Python source."""
    from dsaflow.ops.fp8_gemm import tile_configs
    from dsaflow.ops.fp8_gemm.tile_configs import FP8TileConfig

    current = tile_configs.DENSE_TABLE if kernel == "dense" else tile_configs.GROUPED_TABLE
    swept = {bound: FP8TileConfig(**r["fields"]) for (k, bound), r in best.items() if k == kernel}
    rows = [(b, n, c) for b, n, c in current if b not in swept] + [(b, None, c) for b, c in swept.items()]
    rows.sort(key=lambda r: (r[0] is None, r[0] or 0, r[1] is None, r[1] or 0))
    name = "DENSE_TABLE" if kernel == "dense" else "GROUPED_TABLE"
    return [f"{name}: tuple = ("] + [f"    ({b}, {n}, {c!r})," for b, n, c in rows] + [")"]


def markdown(results: list, best: dict, env: dict) -> str:
    lines = [f"FP8 tile sweep on {env['device_name']} (torch {env['torch']}, triton {env.get('triton', '-')}). Fp8 "
             f"ceiling {CEIL['fp8_tflops']} TFLOP/s, copy {CEIL['copy_tbps']} TB/s, measured in this process. Dense: "
             "CUDA-graph replays, `of bound` = weight bytes / ms against the copy rate. Grouped: eager, `of bound` = "
             f"TFLOP/s against the fp8 ceiling, or, up to {DECODE_ROWS_PER_EXPERT} rows per expert, the weight bytes "
             "of the experts that got a row / ms against the copy rate.", ""]  # fmt: skip
    for kernel in ("dense", "grouped"):
        shapes = DENSE if kernel == "dense" else GROUPED
        for bound in dict.fromkeys(r["bound"] for r in results if r["kernel"] == kernel):
            mine = [r for r in results if r["kernel"] == kernel and r["bound"] == bound]
            lines += [f"### {kernel}, bucket {'<= ' + str(bound) if bound else 'unbounded'} (timed at M = {mine[0]['timed_at']})", "",
                      "| config | " + " | ".join(f"{op} ms (of bound)" for op in shapes) + " | total ms |",
                      "|---|" + "---:|" * (len(shapes) + 1)]  # fmt: skip
            for r in sorted(mine, key=lambda r: r["total_ms"] if r["total_ms"] is not None else float("inf")):
                cells = [
                    f"{r['ms'][op]:.4f} ({100 * r['of_bound'][op]:.0f} %)" if r["ms"].get(op) else "-" for op in shapes
                ]
                total = f"{r['total_ms']:.4f}" if r["total_ms"] is not None else r.get("error", "-")
                mark = " **winner**" if best.get((kernel, bound)) is r else ""
                lines.append(f"| {r['config']}{mark} | " + " | ".join(cells) + f" | {total} |")
            per_shape = {op: min((r for r in mine if r["fields"] and r["ms"].get(op)), key=lambda r: r["ms"][op],
                                 default=None) for op in shapes}  # fmt: skip
            lines += ["", "Each shape's own winner: " + "; ".join(
                f"{op}: {r['config']}" for op, r in per_shape.items() if r) + ".", ""]  # fmt: skip
        lines += ["```python", *table_rows(kernel, best), "```", ""]
    return "\n".join(lines)


def run_sweep(out, command: str) -> int:
    start = time.time()
    measure_ceilings()
    CEIL["fp8_tflops"] = fp8_ceiling()
    results: list = []
    sweep_dense(results)
    print(f"dense done after {time.time() - start:.0f} s", flush=True)
    sweep_grouped(results)
    for r in results:
        rates(r)
    best = winners(results)
    env = environment(command=command)
    data = {"environment": env, "ceilings": CEIL, "seconds": round(time.time() - start), "results": results,
            "winners": {f"{k} <= {b}": r["fields"] for (k, b), r in best.items()}}  # fmt: skip
    text = markdown(results, best, env)
    write_results(out, "bench_fp8_sweep", data, text)
    print(text)
    return 0
