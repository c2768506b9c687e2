"""The radix select's finish at decode-sized calls: the few-row launch (`FEW_ROWS`: 8 warps, 1024-key blocks)
against the many-row one (4 warps, 512-key blocks) on the same scores.

For each shape (rows, cache length; V3.2's indexer: 64 heads x 128, top-2048, every row at the end of its context)
it makes the scores with the one-query logits kernel from random bf16 q and k, runs `radix_topk_triton` under each
launch, checks that the indices are identical, and reports the finish kernel's time and the whole select's device
time (every kernel of a call; torch.profiler over 5 calls: an eager call at these sizes is bound by its launches,
not its kernels). Writes topk_finish.json and topk_finish.md to --out.

    python3 scripts/bench_topk.py finish --out bench_out
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import describe_device, kernel_times, need_cuda, out_dir, write_results

from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton
from dsaflow.ops.indexer_topk.triton_select import radix_topk_triton, select_scratch

SHAPES = ((64, 8192), (64, 32768), (64, 131072), (256, 8192), (8, 8192))
LAUNCHES = {"few-row": dict(BLOCK_FINISH=1024, warps_finish=8), "many-row": dict(BLOCK_FINISH=512, warps_finish=4)}
HEADS, DIM, TOPK = 64, 128, 2048


def measure(B: int, S: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B + S)
    q = torch.randn(B, 1, HEADS, DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, S, DIM, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, 1, HEADS, device="cuda", generator=g)
    pos = torch.full((B, 1), S - 1, device="cuda", dtype=torch.long)
    scores = indexer_logits_triton(q, k, w, pos)
    scratch = select_scratch(B, S, "cuda")
    row, outs = {"rows": B, "keys": S}, []
    for name, cfg in LAUNCHES.items():
        fn = lambda cfg=cfg: radix_topk_triton(scores, pos, TOPK, scratch=scratch, overrides=cfg)  # noqa: E731
        outs.append(fn())
        kernels = {n: ms for n, ms, _ in kernel_times(fn, "cuda", 5)}
        finish = kernels.get("_finish_kernel")
        row[f"{name}_finish_us"] = finish * 1e3 if finish is not None else None
        row[f"{name}_select_us"] = sum(kernels.values()) * 1e3
    row["identical"] = bool(torch.equal(*outs))
    return row


def markdown(rows, device: str) -> str:
    lines = [
        f"Radix select finish at decode-sized calls on {device} (V3.2 indexer, top-{TOPK}; "
        "`scripts/bench_topk.py finish`)",
        "",
        "| rows | keys | finish, few-row launch | finish, many-row launch | select kernels, few-row / many-row | "
        "identical |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['keys']:,} | {r['few-row_finish_us']:.1f} us | {r['many-row_finish_us']:.1f} us | "
            f"{r['few-row_select_us']:.1f} / {r['many-row_select_us']:.1f} us | {r['identical']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str = "bench_topk.py finish") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, args.out)
    rows = [measure(B, S) for B, S in SHAPES]
    device = describe_device()
    write_results(
        out, "topk_finish", {"device": device, "torch": torch.__version__, "rows": rows}, markdown(rows, device)
    )
    return 0
