"""The FP8 KV cache's kernels against the bf16 cache's at decode, one GPU: a JSON file and a markdown table.

    python scripts/bench_kv_fp8.py --out DIR [--rows 64,256] [--context 32768] [--heads 128]

Per row count (a decode step: one query per row at the end of a `--context` cache, DeepSeek-V3.2's dims) and cache
dtype, each timed from a CUDA graph:
  sparse_mla      the attention over each query's 2048 selected rows (split-K decode kernel): bytes = the rows read
                  (bf16: 1,152 per row; fp8: 656) + the queries and outputs;
  indexer_topk    the indexer's logits over every visible key and the top-k select: bytes = the keys read (bf16: 256
                  per key; fp8: 132);
  write           one layer's rows written (bf16: a scatter; fp8: the fused quantize-and-write kernel).
Each row gives the time, its bytes, TB/s and the fraction of the device's measured copy rate; the summary gives
fp8 / bf16 time per kernel and row count.
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import (
    ROWS,
    bench_graph,
    command_line,
    environment,
    measure_ceilings,
    need_cuda,
    out_dir,
    record,
    write_results,
)

from dsaflow.config.kv_cache_format import Fp8RowFormat
from dsaflow.model.cache import write_rows
from dsaflow.ops.indexer_topk import indexer_topk
from dsaflow.ops.kv_fp8 import quantize_fp8_rows, write_fp8_rows
from dsaflow.ops.sparse_mla import sparse_mla

PROG = "bench_kv_fp8.py"
C, R, D_I, H_I, TOPK = 512, 64, 128, 64, 2048
LATENT, KEYS = Fp8RowFormat(C, 128, R), Fp8RowFormat(D_I, D_I)


def caches(rows: int, context: int, kv_dtype: str, g):
    """(latent cache, key cache) [rows, context, ...] of random rows, bf16 or packed FP8 (filled 8 rows at a time:
    the rounding's fp32 transients stay small)."""
    fp8 = kv_dtype == "fp8"
    widths = (LATENT.nbytes, KEYS.nbytes) if fp8 else (C + R, D_I)
    dtype = torch.uint8 if fp8 else torch.bfloat16
    kv, k = (torch.empty(rows, context, w, device="cuda", dtype=dtype) for w in widths)
    for r in range(0, rows, 8):
        for buf, d, fmt in ((kv, C + R, LATENT), (k, D_I, KEYS)):
            x = torch.randn(min(8, rows - r), context, d, device="cuda", dtype=torch.bfloat16, generator=g)
            buf[r : r + 8] = quantize_fp8_rows(x, fmt) if fp8 else x
    return kv, k


def time_decode(rows: int, context: int, heads: int, kv_dtype: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    kv, k = caches(rows, context, kv_dtype, g)
    q = torch.randn(rows, 1, heads, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = (torch.rand(rows, 1, TOPK, device="cuda", generator=g) * context).to(torch.int32).sort(-1).values
    q_i = torch.randn(rows, 1, H_I, D_I, device="cuda", dtype=torch.bfloat16, generator=g)
    w_i = torch.randn(rows, 1, H_I, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.full((rows, 1), context - 1, device="cuda")
    row_bytes = kv.shape[-1] * kv.element_size()
    key_bytes = k.shape[-1] * k.element_size()
    io = rows * heads * (C + R + C) * 2
    ms = bench_graph(lambda: sparse_mla(q, kv, idx, 0.04, C))
    record("sparse_mla", kv_dtype, context, ms, nbytes=rows * TOPK * row_bytes + io, rows=rows, heads=heads)
    ms = bench_graph(lambda: indexer_topk(q_i, k, w_i, pos, TOPK))
    record("indexer_topk", kv_dtype, context, ms, nbytes=rows * context * key_bytes, rows=rows)
    fresh = torch.randn(rows, 1, C + R, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = pos.unsqueeze(-1)
    write = (
        (lambda: write_rows(kv, slots, fresh))
        if kv_dtype == "bf16"
        else (lambda: write_fp8_rows(kv, slots, fresh, LATENT))
    )
    ms = bench_graph(write)
    record("write", kv_dtype, context, ms, nbytes=rows * (row_bytes + (C + R) * 2), rows=rows)
    del kv, k


def markdown(rows: list, env: dict, command: str) -> str:
    lines = [
        f"FP8 against bf16 KV cache reads at decode ({env['device_name']}, `{command}`)",
        "",
        "| kernel | rows | cache | time (ms) | bytes | TB/s | of copy rate | fp8 / bf16 time |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    bf16 = {(r["kernel"], r["rows"]): r["time_ms"] for r in rows if r["impl"] == "bf16"}
    for r in rows:
        ratio = f"{r['time_ms'] / bf16[(r['kernel'], r['rows'])]:.3f}" if r["impl"] == "fp8" else ""
        lines.append(
            f"| {r['kernel']} | {r['rows']} | {r['impl']} | {r['time_ms']:.4f} | {r['bytes']:,} | {r['tbps']:.3f} | "
            f"{r['frac_copy']:.0%} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="64,256", help="decode rows (comma-separated)")
    ap.add_argument("--context", type=int, default=32768, help="cached tokens per row")
    ap.add_argument("--heads", type=int, default=128, help="attention heads (128: V3.2's)")
    args = ap.parse_args(argv)
    need_cuda(PROG)
    out = out_dir(PROG, args.out)
    ceilings = measure_ceilings()
    for rows in (int(x) for x in args.rows.split(",")):
        for kv_dtype in ("bf16", "fp8"):
            time_decode(rows, args.context, args.heads, kv_dtype)
            torch.cuda.empty_cache()
    env = environment(ceilings=ceilings)
    command = command_line(PROG, argv)
    write_results(out, "bench_kv_fp8", dict(env=env, command=command, rows=ROWS), markdown(ROWS, env, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
