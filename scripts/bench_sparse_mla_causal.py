"""Sparse MLA forward and backward on the causal top-k layout of training, with and without the key-extent bound.

    python scripts/bench_sparse_mla_causal.py --seq 4096,16384 --out bench_out/causal

One sequence of `seq` tokens, every token a query, V3.2 attention shapes (h128, d_qk 576, d_v 512, topk 2048, bf16).
Indices have the indexer's layout: query t selects min(t + 1, topk) keys in [0, t] (random scores), in ascending
key order as the op returns them, padded with -1, so queries t < topk have fewer keys than slots. Each kernel is
timed (triton.testing.do_bench median) with its loops stopped at each query's key extent (the default, n_keys =
`key_extent`) and over all topk slots (n_keys = topk everywhere), in one process, next to the bf16 8192^3 matmul
ceiling. Also timed: `key_extent` itself, and the torch fp32 delta = rowsum(dO * O) (casts, product,
sum) that pass 1 of the backward now computes. FLOP rates are given two ways: nominal (all topk slots, the
count docs/kernels.md uses: fwd 2 H K (d_qk + d_v), bwd 2 H K (3 d_qk + 2 d_v) per query) and over the valid pairs
only (sum of n_keys instead of T K). Before timing, the bounded and unbounded results are compared.
Writes <out>/bench_sparse_mla_causal.json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
from bench_hopper import hp, rec, tp
from bench_lib import D_QK, D_V, ROWS, TOPK, H, bench, environment, measure_ceilings, need_cuda, out_dir, write_results

from dsaflow.ops.indexer_topk import ascending_keys

tb = importlib.import_module("dsaflow.ops.sparse_mla.triton_backward")


def causal_topk(S: int, K: int, seed: int) -> torch.Tensor:
    """[1, S, K] int32: for query t, the min(t + 1, K) best keys of [0, t] by a random score, in ascending key order
    (the top-k op's layout), then -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.empty(1, S, K, device="cuda", dtype=torch.int32)
    for t0 in range(0, S, 2048):
        t1 = min(S, t0 + 2048)
        sc = torch.rand(t1 - t0, S, device="cuda", generator=g)
        sc = sc.masked_fill(torch.arange(S, device="cuda") > torch.arange(t0, t1, device="cuda")[:, None], -1.0)
        val, sel = sc.topk(min(K, S), dim=-1)
        sel = ascending_keys(torch.where(val < 0, -1, sel).int())
        idx[0, t0:t1, : sel.shape[1]] = sel
        idx[0, t0:t1, sel.shape[1] :] = -1
    return idx


def old_delta(out, d_out):
    """The removed torch path: fp32 casts of O and dO, their product and the row sum."""
    B, T, Hh, dv = out.shape
    o, do = out.reshape(B * T, Hh, dv), d_out.reshape(B * T, Hh, dv)
    delta = torch.empty(B * T, Hh, device=out.device, dtype=torch.float32)
    step = max(1, 2**27 // (Hh * dv))
    for s in range(0, B * T, step):
        delta[s : s + step] = (do[s : s + step].float() * o[s : s + step].float()).sum(-1)
    return delta


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run(S: int, mm: float, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, S, H, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(1, S, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_topk(S, TOPK, seed)
    K = idx.shape[-1]
    scale = D_QK**-0.5
    nk = tp.key_extent(idx, S)
    full = torch.full_like(nk, K)
    pairs, slots = nk.sum().item(), S * K
    fwd_nom = 2 * H * slots * (D_QK + D_V)
    bwd_nom = 2 * H * slots * (3 * D_QK + 2 * D_V)

    def row(kernel, variant, ms, nominal):
        rec(
            seq=S,
            kernel=kernel,
            variant=variant,
            time_ms=round(ms, 4),
            tflops_nominal=round(nominal / ms / 1e9, 1),
            frac_matmul=round(nominal / ms / 1e9 / mm, 3),
            tflops_valid_pairs=round(nominal * pairs / slots / ms / 1e9, 1),
            valid_pair_share=round(pairs / slots, 4),
        )

    row("key_extent", "", bench(lambda: tp.key_extent(idx, S)), 0)
    fwds = {"triton": lambda n: tp.sparse_mla_fwd_triton(q, kv, idx, scale, D_V, n_keys=n)}
    if hp.hopper_fwd_supports(q, kv, idx, D_V) is None:
        fwds["hopper"] = lambda n: hp.sparse_mla_fwd_hopper(q, kv, idx, scale, D_V, n_keys=n)
    for name, f in fwds.items():
        (o1, l1), (o2, l2) = f(nk), f(full)
        assert rel(o1, o2) < 1e-2 and torch.equal(torch.isinf(l1), torch.isinf(l2)), f"{name}: extent changes out"
        row(f"sparse_mla_fwd {name}", "key extent", bench(lambda: f(nk)), fwd_nom)
        row(f"sparse_mla_fwd {name}", "all slots", bench(lambda: f(full)), fwd_nom)
    out, lse = (hp.sparse_mla_fwd_hopper if "hopper" in fwds else tp.sparse_mla_fwd_triton)(q, kv, idx, scale, D_V)
    do = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def bwd(n, det=False):
        return tb.sparse_mla_bwd_triton(q, kv, idx, out, lse, do, None, scale, D_V, deterministic=det, n_keys=n)

    (dq1, dkv1), (dq2, dkv2) = bwd(nk), bwd(full)
    errs = (rel(dq1, dq2), rel(dkv1, dkv2))
    print(f"seq {S}: bwd extent vs all slots rel err dq {errs[0]:.2e} dkv {errs[1]:.2e}", flush=True)
    assert max(errs) < 1e-2
    del dq1, dkv1, dq2, dkv2
    row("sparse_mla_bwd", "key extent", bench(lambda: bwd(nk), rep_ms=300), bwd_nom)
    row("sparse_mla_bwd", "all slots", bench(lambda: bwd(full), rep_ms=300), bwd_nom)
    row("sparse_mla_bwd (deterministic)", "key extent", bench(lambda: bwd(nk, True), rep_ms=300), bwd_nom)
    row("torch delta (removed)", "", bench(lambda: old_delta(out, do)), 0)


def markdown(meta) -> str:
    lines = [
        f"Device: {meta['device']} (torch {meta['torch']}, triton {meta['triton']}); bf16 matmul ceiling "
        f"{meta['matmul_tflops']:.0f} TFLOP/s. Causal top-{TOPK} layout, h{H}, d_qk {D_QK}, d_v {D_V}.",
        "",
        "| seq | kernel | loop bound | ms | TFLOP/s nominal (all slots) | % of matmul | TFLOP/s on valid pairs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        frac = f"{100 * r['frac_matmul']:.1f}" if r["frac_matmul"] else ""
        lines.append(
            f"| {r['seq']} | {r['kernel']} | {r['variant']} | {r['time_ms']:.3f} | "
            f"{r['tflops_nominal'] or ''} | {frac} | {r['tflops_valid_pairs'] or ''} |"
        )
    shares = sorted({(r["seq"], r["valid_pair_share"]) for r in ROWS})
    lines += ["", "Valid (query, key) pairs / (T x topk): " + ", ".join(f"{s}: {v:.3f}" for s, v in shares)]
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str = "bench_sparse_mla_causal.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="4096")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, args.out)
    mm = measure_ceilings()["matmul_tflops"]
    e = environment()
    meta = dict(device=e["device_name"], torch=e["torch"], triton=e["triton"], matmul_tflops=mm)
    t0 = time.time()
    for s in (int(x) for x in args.seq.split(",")):
        run(s, mm)
        torch.cuda.empty_cache()
    meta["seconds"] = round(time.time() - t0, 1)
    write_results(out, "bench_sparse_mla_causal", dict(meta=meta, rows=ROWS), markdown(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
