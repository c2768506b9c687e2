"""Sparse MLA forward on Hopper: the Gluon seesaw kernel (and any launch configs of it) vs the Triton kernel, plus
decode configs of the split-K Triton kernel.

    python scripts/bench_hopper.py --out bench_out/hopper                  # everything, one process
    python scripts/bench_hopper.py --out DIR --part fwd --variant seesaw   # one forward variant (own process)

Forward: 4096 queries at the end of an 8K-128K context, h128, d_qk 576, d_v 512, topk 2048, bf16; FLOPs
2 H K (d_qk + d_v) per query. Each variant is first checked against the naive fp32 reference on sampled queries
(with invalid indices and one query without keys) and against the Triton kernel's full output, then timed with
triton.testing.do_bench (median) next to the Triton kernel and the bf16 8192^3 matmul ceiling of the same process.
Decode: 128 sequences x 1 token x 16 heads (a TP-8 shard), 32K cache, topk 2048; bytes = gathered rows
(128 x 2048 x 576 x 2) + q + out + indices, against the device copy rate of the same process; and 8-128 sequences
x 1 token x 128 heads (compute-bound: TFLOP/s), split-K Triton kernel against the Hopper forward.
Each query's keys are sorted ascending, as the top-k op returns them (--index-order random: unsorted). Writes
<out>/bench_hopper_<part>[_random].json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch
from bench_lib import D_QK, D_V, ROWS, TOPK, H, bench, environment, measure_ceilings, need_cuda, out_dir, write_results

hp = importlib.import_module("dsaflow.ops.sparse_mla.hopper_seesaw")
tp = importlib.import_module("dsaflow.ops.sparse_mla.triton_prefill")
td = importlib.import_module("dsaflow.ops.sparse_mla.triton_decode")
naive = importlib.import_module("dsaflow.ops.sparse_mla.naive")

VARIANTS = {  # launch configs of the seesaw kernel over hopper_seesaw.SEESAW_CFG
    "seesaw": dict(),  # the default
    "seesaw_regs_48_232": dict(PRODUCER_REGS=48, CONSUMER_REGS=232),
}


def rec(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def ceilings():
    ceil = measure_ceilings()
    rec(kind="ceiling", **ceil)
    return ceil["matmul_tflops"], ceil["copy_tbps"]


def inputs(ctx, n_q, h=H, batch=1, seed=0, invalid=False, order="ascending"):
    """Query i sits at position ctx - n_q + i and selects TOPK uniform random keys of [0, position] (a few repeat):
    order "ascending" sorts them by key, the layout the top-k op returns; "random" leaves them unsorted."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, n_q, h, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(batch, ctx, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(ctx - n_q, ctx, device="cuda").view(1, n_q, 1)
    idx = (torch.rand(batch, n_q, TOPK, device="cuda", generator=g) * (pos + 1)).to(torch.int32)
    if order == "ascending":
        idx = idx.sort(dim=-1).values
    if invalid:
        idx[:, :, ::7] = -1
        idx[:, :, 3::11] = ctx + 5
        idx[0, 1] = -1
    return q, kv, idx


def fwd_part(variants, contexts, mm, order):
    scale = D_QK**-0.5
    # correctness on a small problem with invalid indices and a query without keys
    q, kv, idx = inputs(8192, 64, invalid=True, seed=3)
    ref_o, ref_l = naive.sparse_mla_naive(q[:, :8].float(), kv.float(), idx[:, :8], scale, D_V)
    for name in variants:
        t0 = time.time()
        try:
            o = torch.full((*q.shape[:3], D_V), float("nan"), device="cuda", dtype=q.dtype)
            l = torch.full(q.shape[:3], float("nan"), device="cuda")
            k = hp.launch_hopper_fwd(q, kv, idx, scale, D_V, o, l, VARIANTS[name])
            torch.cuda.synchronize()
            regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
        except Exception as e:
            rec(kind="fwd_check", variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        err = ((o[:, :8].double() - ref_o.double()).norm() / ref_o.double().norm()).item()
        fin = torch.isfinite(ref_l)
        lerr = (l[:, :8][fin] - ref_l[fin]).abs().max().item()
        rec(
            kind="fwd_check",
            variant=name,
            rel_err=err,
            lse_err=lerr,
            nan=bool(torch.isnan(o).any()),
            empty_ok=bool(torch.isinf(l[0, 1]).all() and (o[0, 1] == 0).all()),
            compile_s=round(time.time() - t0, 1),
            regs=regs,
            spills=spills,
            shared=getattr(k, "metadata", None) and k.metadata.shared,
        )
    for ctx in contexts:
        q, kv, idx = inputs(ctx, 4096, order=order)
        flops = 2 * H * TOPK * (D_QK + D_V) * 4096
        o_t, l_t = tp.sparse_mla_fwd_triton(q, kv, idx, scale, D_V)
        ms = bench(lambda: tp.sparse_mla_fwd_triton(q, kv, idx, scale, D_V))
        rec(
            kind="fwd",
            impl="triton",
            ctx=ctx,
            ms=round(ms, 3),
            tflops=round(flops / ms / 1e9, 1),
            frac_mm=round(flops / ms / 1e9 / mm, 3),
        )
        for name in variants:
            try:
                o, l = hp.sparse_mla_fwd_hopper(q, kv, idx, scale, D_V, VARIANTS[name])
                diff = (o.float() - o_t.float()).abs().max().item()
                ldiff = (l - l_t).abs().max().item()
                ms = bench(lambda: hp.sparse_mla_fwd_hopper(q, kv, idx, scale, D_V, VARIANTS[name]))
                rec(
                    kind="fwd",
                    impl=f"gluon-{name}",
                    ctx=ctx,
                    ms=round(ms, 3),
                    tflops=round(flops / ms / 1e9, 1),
                    frac_mm=round(flops / ms / 1e9 / mm, 3),
                    maxdiff_vs_triton=diff,
                    lse_maxdiff=ldiff,
                )
            except Exception as e:
                rec(kind="fwd", impl=f"gluon-{name}", ctx=ctx, error=f"{type(e).__name__}: {str(e)[:300]}")
        del q, kv, idx, o_t, l_t


def decode_part(cp, configs, order):
    scale = D_QK**-0.5
    B, h, ctx = 128, 16, 32768
    q, kv, idx = inputs(ctx, 1, h=h, batch=B, seed=1, order=order)
    nbytes = B * TOPK * D_QK * 2 + q.numel() * 2 + B * h * D_V * 2 + idx.numel() * 4
    ref_o, ref_l = td.sparse_mla_decode_triton(q, kv, idx, scale, D_V)

    def split_k(cfg):
        ov = {k: v for k, v in cfg.items() if k != "num_splits"} or None
        return lambda: td.sparse_mla_decode_triton(
            q, kv, idx, scale, D_V, num_splits=cfg.get("num_splits"), overrides=ov
        )

    runs = [(cfg, split_k(cfg)) for cfg in configs]
    for name, fn in runs:
        try:
            diff = (fn()[0].float() - ref_o.float()).abs().max().item()
            ms = bench(fn)
            tb = nbytes / ms / 1e9
            rec(kind="decode", cfg=name, ms=round(ms, 4), tbps=round(tb, 3), frac_copy=round(tb / cp, 3), maxdiff=diff)
        except Exception as e:
            rec(kind="decode", cfg=name, error=f"{type(e).__name__}: {str(e)[:200]}")


def decode_h128_part(mm, order, batches=(8, 16, 32, 64, 128)):
    """All 128 heads per query (V3.2 attention on one GPU): B seqs x 1 token, 32K cache, topk 2048. The split-K
    Triton kernel against the Hopper forward (which `sparse_mla` without grad runs when one split fills the GPU);
    compute-bound, so rates are TFLOP/s against the matmul ceiling."""
    scale = D_QK**-0.5
    for B in batches:
        q, kv, idx = inputs(32768, 1, batch=B, seed=2, order=order)
        flops = 2 * H * TOPK * (D_QK + D_V) * B
        ref_o, _ = td.sparse_mla_decode_triton(q, kv, idx, scale, D_V)
        for name, fn in (
            ("split-K triton", lambda: td.sparse_mla_decode_triton(q, kv, idx, scale, D_V)),
            ("hopper forward", lambda: hp.sparse_mla_fwd_hopper(q, kv, idx, scale, D_V)),
        ):
            diff = (fn()[0].float() - ref_o.float()).abs().max().item()
            ms = bench(fn)
            rec(
                kind="decode_h128",
                cfg=f"{name}, {B} seqs",
                ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 1),
                frac_mm=round(flops / ms / 1e9 / mm, 3),
                maxdiff=diff,
            )


DECODE_CONFIGS = [  # merged over triton_decode.decode_overrides (8 warps for this shape)
    {},  # the committed rule: 2 splits, BLOCK_K 64, 2 stages, 8 warps
    dict(num_warps=4),  # the prefill kernel's warps
    dict(num_splits=4),
    dict(num_splits=2, BLOCK_K=32),
]


def main(argv=None, prog: str = "bench_hopper.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/hopper")
    ap.add_argument("--part", default="all", choices=("all", "fwd", "decode"))
    ap.add_argument("--variant", default="seesaw", help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    ap.add_argument(
        "--index-order",
        default="ascending",
        choices=("ascending", "random"),
        help="order of each query's selected keys: the top-k op's (ascending) or unsorted",
    )
    args = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, args.out)
    e = environment()
    rec(kind="env", device=e["device_name"], triton=e["triton"], torch=e["torch"], index_order=args.index_order)
    mm, cp = ceilings()
    if args.part in ("all", "fwd"):
        fwd_part(args.variant.split(","), [int(c) for c in args.contexts.split(",")], mm, args.index_order)
    if args.part in ("all", "decode"):
        decode_part(cp, DECODE_CONFIGS, args.index_order)
        decode_h128_part(mm, args.index_order)
    tag = args.part if args.part != "fwd" else f"fwd_{args.variant.replace(',', '_')}"
    tag += "" if args.index_order == "ascending" else "_random"
    lines = [
        "| kind | impl / cfg | ctx | ms | TFLOP/s or TB/s | fraction of ceiling | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        if r["kind"] in ("fwd", "decode", "decode_h128"):
            rate = r.get("tflops", r.get("tbps", ""))
            frac = r.get("frac_mm", r.get("frac_copy", ""))
            chk = r.get("error") or f"maxdiff {r.get('maxdiff_vs_triton', r.get('maxdiff', ''))}"
            lines.append(
                f"| {r['kind']} | {r.get('impl', r.get('cfg'))} | {r.get('ctx', 32768)} | {r.get('ms', '')} "
                f"| {rate} | {frac} | {chk} |"
            )
    write_results(out, f"bench_hopper_{tag}", ROWS, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
