"""Benchmark the lightning indexer op: logits + radix-select top-k vs the same logits + torch.topk.

Shapes: DeepSeek-V3.2 indexer (64 heads x 128, topk 2048, bf16), one sequence; by default the last 4096 queries of an
8K / 32K / 128K context (the same queries as `bench_ops.py`), plus one whole causal prefill (every query of a 32K
context, chunked). Rows: the whole op with each selector, its parts (fp32 logits with invisible tiles unwritten,
radix select alone on those scores, torch.topk + sort alone, the fp8 logits and the fp8 rounding of q and k), the
whole op with fp8 logits (`model.index_fp8`, with the share of the bf16 selection it keeps), and at the
largest context a sweep of the select kernels (block sizes, warps, sample size, no floor), of the logits kernel's
tile, and decode-like row counts (--no-sweeps skips them). Writes indexer_topk.json and indexer_topk.md to --out.

    python3 scripts/bench_topk.py indexer --out /tmp/bench [--contexts 8192,32768,131072] [--queries 4096] \
        [--no-sweeps]
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import bench as harness_bench
from bench_lib import environment, need_cuda, out_dir, write_results

from benches.topk_select import indexer_logits, same_selection, torch_topk_indexer, torch_topk_select
from dsaflow.ops.indexer_topk.fp8 import quantize_rows
from dsaflow.ops.indexer_topk.triton_indexer import (
    indexer_logits_triton,
    indexer_topk_triton,
    quantize_rows_triton,
    query_chunk,
)
from dsaflow.ops.indexer_topk.triton_select import radix_topk_triton, select_scratch

H_I, D_I, TOPK = 64, 128, 2048


def bench(fn, rep_ms=200) -> float:
    return harness_bench(fn, rep_ms=rep_ms, warmup_ms=30)


def inputs(S: int, T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H_I, D_I, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, S, D_I, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, T, H_I, device="cuda", generator=g).bfloat16()
    pos = torch.arange(S - T, S, device="cuda").unsqueeze(0)
    return q, k, w, pos


def selection_recall(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of ref's selected keys (-1 excluded) that got also selects, over all rows."""
    hit = total = 0
    for g_row, r_row in zip(got.flatten(0, -2), ref.flatten(0, -2)):
        r = r_row[r_row >= 0]
        total += r.numel()
        hit += int(torch.isin(r, g_row[g_row >= 0]).sum())
    return hit / max(total, 1)


def run(contexts, n_queries, prefill_ctx, out, sweeps=True):
    rows = []

    def record(what, ctx, queries, ms, **extra):
        rows.append(dict(what=what, context=ctx, queries=queries, time_ms=round(ms, 4), **extra))
        print(f"{what:55s} ctx {ctx:7d} queries {queries:6d} {ms:9.3f} ms {extra or ''}", flush=True)

    for S in contexts:
        T = min(n_queries, S)
        q, k, w, pos = inputs(S, T)
        visible = int((pos + 1).clamp(max=S).sum())
        flops = 2 * H_I * D_I * visible
        new, new8 = indexer_topk_triton(q, k, w, pos, TOPK), indexer_topk_triton(q, k, w, pos, TOPK, fp8=True)
        same = same_selection(new, torch_topk_indexer(q, k, w, pos, TOPK), indexer_logits(q, k, w, pos))
        same8 = same_selection(
            new8, torch_topk_indexer(q, k, w, pos, TOPK, fp8=True), indexer_logits(q, k, w, pos, True)
        )
        ms_torch = bench(lambda: torch_topk_indexer(q, k, w, pos, TOPK))
        ms_new = bench(lambda: indexer_topk_triton(q, k, w, pos, TOPK))
        ms_auto = bench(lambda: indexer_topk_triton(q, k, w, pos, TOPK))
        ms_fp8 = bench(lambda: indexer_topk_triton(q, k, w, pos, TOPK, fp8=True))
        record("op: logits + torch.topk + sort", S, T, ms_torch)
        record(
            "op: logits + select kernels",
            S,
            T,
            ms_new,
            speedup=round(ms_torch / ms_new, 2),
            same_selection=same,
            tflops=round(flops / ms_new / 1e9, 1),
        )
        record("op: default (select=auto)", S, T, ms_auto, speedup=round(ms_torch / ms_auto, 2))
        record(
            "op: fp8 logits + default select (model.index_fp8=true)",
            S,
            T,
            ms_fp8,
            speedup=round(ms_torch / ms_fp8, 2),
            same_selection_as_fp8_torch_topk=same8,
            recall_of_bf16_selection=round(selection_recall(new8, new), 4),
            tflops=round(flops / ms_fp8 / 1e9, 1),
        )
        del new, new8
        chunk = query_chunk(1, T, S)
        qc, wc, pc = q[:, :chunk], w[:, :chunk], pos[:, :chunk]
        scores = torch.empty(1, chunk, S, device="cuda")
        scratch = select_scratch(chunk, S, "cuda")
        chunk_flops = 2 * H_I * D_I * int((pc + 1).sum())
        ms = bench(lambda: indexer_logits_triton(qc, k, wc, pc, scores, write_invisible=False))
        record("part: fp32 logits (invisible tiles unwritten)", S, chunk, ms, tflops=round(chunk_flops / ms / 1e9, 1))
        q8, _, w8 = quantize_rows_triton(qc, wc)
        k8, k_scale = quantize_rows_triton(k)
        ms = bench(lambda: indexer_logits_triton(q8, k8, w8, pc, scores, write_invisible=False, k_scale=k_scale))
        record("part: fp32 logits from fp8 q, k", S, chunk, ms, tflops=round(chunk_flops / ms / 1e9, 1))
        ms = bench(lambda: (quantize_rows_triton(q, w), quantize_rows_triton(k)))
        codes_differ = int(
            (quantize_rows_triton(q)[0].view(torch.uint8) != quantize_rows(q)[0].view(torch.uint8)).sum()
        )
        record(
            "part: fp8 rounding of q and k (all queries)",
            S,
            T,
            ms,
            q_codes_unlike_torch_cast=f"{codes_differ} of {q.numel()}",
        )
        if S == contexts[-1] and sweeps:  # the logits kernel's tile, bf16 and fp8
            for lc in (
                dict(BLOCK_T=64, BLOCK_S=128, num_warps=4, num_stages=4),
                dict(BLOCK_T=64, BLOCK_S=256, num_warps=8, num_stages=3),
                dict(BLOCK_T=128, BLOCK_S=128, num_warps=8, num_stages=3),
            ):
                name = " ".join(f"{a} {v}" for a, v in lc.items())
                ms = bench(
                    lambda: indexer_logits_triton(qc, k, wc, pc, scores, write_invisible=False, overrides=lc),
                    rep_ms=100,
                )
                record(f"sweep: logits {name}", S, chunk, ms, tflops=round(chunk_flops / ms / 1e9, 1))
                ms = bench(
                    lambda: indexer_logits_triton(
                        q8, k8, w8, pc, scores, write_invisible=False, k_scale=k_scale, overrides=lc
                    ),
                    rep_ms=100,
                )
                record(f"sweep: fp8 logits {name}", S, chunk, ms, tflops=round(chunk_flops / ms / 1e9, 1))
        del q8, k8, w8
        indexer_logits_triton(qc, k, wc, pc, scores, write_invisible=False)  # the select parts read bf16 scores
        full_scores = indexer_logits_triton(qc, k, wc, pc)  # torch.topk reads every key, the invisible ones -inf
        ms = bench(lambda: torch_topk_select(full_scores, TOPK))
        record("part: torch.topk + sort", S, chunk, ms)
        ms = bench(lambda: radix_topk_triton(scores, pc, TOPK, scratch=scratch))
        record("part: radix select", S, chunk, ms, tbps_one_read=round(4 * int((pc + 1).sum()) / ms / 1e9, 3))
        sweep = []
        if S == contexts[-1] and sweeps:  # one knob at a time around the defaults (`select_config`)
            sweep += [dict(BLOCK=bl, warps_compact=wp) for bl in (256, 512, 1024) for wp in (1, 2)]
            sweep += [dict(BLOCK_FINISH=bl, warps_finish=wp) for bl in (512, 1024) for wp in (4, 8)]
            sweep += [dict(SAMPLE=sm) for sm in (512, 1024, 2048)]
            sweep += [dict(whole_row=True)]
        for cfg in sweep:
            ms = bench(lambda: radix_topk_triton(scores, pc, TOPK, scratch=scratch, overrides=cfg), rep_ms=100)
            record("sweep: select " + " ".join(f"{k} {v}" for k, v in cfg.items()), S, chunk, ms)
        if S == contexts[-1] and sweeps:
            for n_rows in (1, 8, 64):  # decode-like: a few rows of the longest context
                ms = bench(lambda: radix_topk_triton(scores[:, :n_rows], pc[:, :n_rows], TOPK, scratch=scratch))
                record(f"decode-like: select, {n_rows} rows", S, n_rows, ms)
                ms = bench(lambda: torch_topk_select(full_scores[:, :n_rows], TOPK))
                record(f"decode-like: torch.topk + sort, {n_rows} rows", S, n_rows, ms)
        del scores, full_scores, scratch
    if prefill_ctx:
        S = prefill_ctx
        q, k, w, pos = inputs(S, S)
        same = same_selection(
            indexer_topk_triton(q, k, w, pos, TOPK),
            torch_topk_indexer(q, k, w, pos, TOPK),
            indexer_logits(q, k, w, pos),
        )
        ms_torch = bench(lambda: torch_topk_indexer(q, k, w, pos, TOPK), rep_ms=300)
        ms_new = bench(lambda: indexer_topk_triton(q, k, w, pos, TOPK), rep_ms=300)
        record("whole causal prefill: logits + torch.topk", S, S, ms_torch)
        record(
            "whole causal prefill: logits + select kernels",
            S,
            S,
            ms_new,
            speedup=round(ms_torch / ms_new, 2),
            same_selection=same,
            tflops=round(2 * H_I * D_I * S * (S + 1) / 2 / ms_new / 1e9, 1),
        )
    e = environment()
    meta = dict(device=e["device_name"], torch=e["torch"], triton=e["triton"])
    lines = [
        f"Indexer op on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}); 64 heads x 128, "
        f"topk {TOPK}, bf16, one sequence.",
        "",
        "| what | context | queries | ms | notes |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("what", "context", "queries", "time_ms"))
        lines.append(f"| {r['what']} | {r['context']} | {r['queries']} | {r['time_ms']} | {notes} |")
    write_results(out, "indexer_topk", dict(meta=meta, rows=rows), "\n".join(lines))


def main(argv=None, prog: str = "bench_topk.py indexer") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--prefill-context", type=int, default=32768, help="0 skips the whole-prefill row")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the sweeps and the decode-like rows")
    a = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, a.out)
    run([int(c) for c in a.contexts.split(",")], a.queries, a.prefill_context, out, sweeps=not a.no_sweeps)
    return 0
