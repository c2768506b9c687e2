"""Benchmark the indexer at decode steps (one query per row): the one-query logits kernel against the tiled one.

For each shape (rows, indexer heads x dim, cache length, filled positions) it times, with CUDA-graph replay (a decode
step is a few microseconds, below what eager timing resolves):
- the logits alone through the one-query kernel (the default for T == 1) and through the tiled kernel (forced by a
  config override), with invisible tiles unwritten as in the op;
- the whole op (`indexer_topk_triton`: logits + radix select).
It checks that the two kernels' scores agree (relative to the row scale) and reports the key bytes read per second.
Writes indexer_decode.json and indexer_decode.md to --out.

    python3 scripts/bench_topk.py decode --out /tmp/bench
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import bench_graph, describe_device, need_cuda, out_dir, write_results

from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, indexer_topk_triton

# (label, rows, heads, head dim, cache rows, positions drawn from [filled / 2, filled), top-k)
SHAPES = [
    ("model=small", 64, 8, 64, 4353, 2000, 256),
    ("model=small", 64, 8, 64, 4353, 4000, 256),
    ("model=small", 8, 8, 64, 4353, 2000, 256),
    ("V3.2 indexer", 64, 64, 128, 32769, 30000, 2048),
    ("V3.2 indexer", 8, 64, 128, 131073, 120000, 2048),
]


def us(fn) -> float:
    return bench_graph(fn, rep_ms=50) * 1e3


def measure(label, B, H, D, S, filled, topk) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B * S)
    q = torch.randn(B, 1, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, S, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, 1, H, device="cuda", generator=g).bfloat16()
    pos = torch.randint(filled // 2, filled, (B, 1), device="cuda", generator=g)
    out = torch.empty(B, 1, S, device="cuda")
    tiled_cfg = dict(BLOCK_S=128)  # any override selects the tiled kernel (its default tile)
    one = indexer_logits_triton(q, k, w, pos, out.clone(), write_invisible=False)
    tiled = indexer_logits_triton(q, k, w, pos, out.clone(), tiled_cfg, write_invisible=False)
    vis = torch.arange(S, device="cuda").view(1, 1, -1) <= pos.unsqueeze(-1)
    rel = ((one - tiled).abs()[vis].max() / tiled[vis].abs().max()).item()
    t_one = us(lambda: indexer_logits_triton(q, k, w, pos, out, write_invisible=False))
    t_tiled = us(lambda: indexer_logits_triton(q, k, w, pos, out, tiled_cfg, write_invisible=False))
    t_op = us(lambda: indexer_topk_triton(q, k, w, pos, topk))
    key_bytes = int(vis.sum()) * D * k.element_size()
    return dict(
        shape=label, rows=B, heads=H, head_dim=D, cache=S, mean_visible=round(key_bytes / (D * 2 * B)),
        topk=topk, one_query_us=t_one, tiled_us=t_tiled, speedup=t_tiled / t_one, op_us=t_op,
        one_query_key_gbps=key_bytes / t_one / 1e3, max_rel_diff=rel,
    )  # fmt: skip


def markdown(rows, device: str) -> str:
    lines = [
        f"Indexer logits at decode steps on {device} (bf16, CUDA-graph timing; `scripts/bench_topk.py decode`)",
        "",
        "| shape | rows | heads x dim | keys visible (mean) | one-query | tiled | speedup | key GB/s | whole op | rel diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['heads']} x {r['head_dim']} | {r['mean_visible']:,} | "
            f"{r['one_query_us']:.1f} us | {r['tiled_us']:.1f} us | {r['speedup']:.2f}x | "
            f"{r['one_query_key_gbps']:,.0f} | {r['op_us']:.1f} us | {r['max_rel_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str = "bench_topk.py decode") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    need_cuda(prog, why="the kernels are timed with CUDA graphs")
    out = out_dir(prog, args.out)
    rows = [measure(*shape) for shape in SHAPES]
    device = describe_device()
    data = {"device": device, "torch": torch.__version__, "rows": rows}
    write_results(out, "indexer_decode", data, markdown(rows, device))
    return 0
