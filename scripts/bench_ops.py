"""Benchmark the DSA kernels at DeepSeek-V3.2 shapes against the device's measured ceilings.

Measures (CUDA only): the bf16 matmul and copy ceilings; sparse MLA prefill forward and backward, default and
deterministic (h128, d_qk 576, d_v 512, topk 2048, 4096 / 2048 queries at the end of 8K, 32K, 128K contexts; on
sm_90 also the backward with the Gluon pass 1, checked against the portable one, and that pass alone); split-K
decode; the indexer logits kernel and its torch.topk (64 heads x 128); the same shapes through torch references; and
dense causal SDPA as the no-sparsity baseline. A small config sweep runs first at 32K and the best config is used
for the table.
With cuDNN-Frontend installed (`pip install 'dsaflow[peers]'`), section `peers` times its sparse-attention backward
beside dsaflow's (with the pass 1 its rule picks) on the same inputs (the backward shapes above, and batch 2 at the
first context), checks that dq and dkv agree, and reports the time ratio and which backward the dispatcher picks
(`sparse_mla/dispatch.py`); then the same with the indexer-loss target (`probs_into`): dsaflow's backward (its pass 1
sums P) beside cuDNN-Frontend's followed by dsaflow's target pass (`triton_probs.py`), the target pass alone, and
the indexer-loss op's `attention_target` kernel on the same target for reference. Without --no-sweep the target
pass's tiles are swept at the first context first.
Writes <out>/bench_ops.json and <out>/bench_ops.md.

    PYTHONPATH=. python scripts/bench_ops.py --out bench_out [--contexts 8192,32768,131072] [--no-sweep]
    PYTHONPATH=. python scripts/bench_ops.py --out bench_out --only peers --no-sweep   # the side-by-side only
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from bench_lib import (
    CEIL,
    D_QK,
    D_V,
    ROWS,
    TOPK,
    H,
    bench,
    environment,
    measure_ceilings,
    mla_inputs,
    need_cuda,
    out_dir,
    record,
    rel_err,
    sweep,
    timed_slow,
    write_results,
)
from benches.ops_peers import PEERS, bench_backward_peers, peers_markdown

from dsaflow.ops.indexer_topk.naive import topk_from_scores
from dsaflow.ops.indexer_topk.triton_indexer import (
    indexer_logits_triton,
    indexer_topk_triton,
    query_chunk,
)
from dsaflow.ops.sparse_mla.hopper_backward import hopper_bwd_supports, launch_hopper_ds
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_decode import sparse_mla_decode_triton
from dsaflow.ops.sparse_mla.triton_prefill import key_extent, sparse_mla_fwd_triton

H_I, D_I = 64, 128


def torch_sparse_mla(q, kv, idx, scale, chunk=256):
    """bf16 torch reference: gather rows, einsum, fp32 softmax, einsum."""
    out = torch.empty(*q.shape[:3], D_V, device=q.device, dtype=q.dtype)
    for t0 in range(0, q.shape[1], chunk):
        rows = kv[0][idx[0, t0 : t0 + chunk].long()]  # [t, K, D]
        s = torch.einsum("thd,tkd->thk", q[0, t0 : t0 + chunk], rows).float() * scale
        p = s.softmax(-1).to(q.dtype)
        out[0, t0 : t0 + chunk] = torch.einsum("thk,tkd->thd", p, rows[..., :D_V])
    return out


def bench_sparse_mla(contexts, do_sweep):
    scale = D_QK**-0.5
    n_fwd, n_bwd = 4096, 2048
    fwd_flops = 2 * H * TOPK * (D_QK + D_V) * n_fwd
    bwd_flops = 2 * H * TOPK * (3 * D_QK + 2 * D_V) * n_bwd
    fwd_cfg = bwd_cfg = None
    if do_sweep:
        q, kv, idx = mla_inputs(32768, n_fwd)
        fwd_cfg = sweep(
            "sparse_mla_fwd",
            lambda c: lambda: sparse_mla_fwd_triton(q, kv, idx, scale, D_V, c),
            [
                {},  # 3 stages, BLOCK_H 128 x 16 warps, a d_v split and warp_specialize all measured slower
            ],
        )
        qb, kvb, idxb = q[:, :n_bwd], kv, idx[:, :n_bwd]
        out, lse = sparse_mla_fwd_triton(qb, kvb, idxb, scale, D_V)
        do = torch.randn_like(out)
        gemm = lambda bk, bn, bj, w, st: dict(
            gemm_BLOCK_K=bk,
            gemm_BLOCK_N=bn,
            gemm_BLOCK_J=bj,  # noqa: E731
            gemm_num_warps=w,
            gemm_num_stages=st,
        )
        bwd_cfg = sweep(
            "sparse_mla_bwd",
            lambda c: lambda: sparse_mla_bwd_triton(qb, kvb, idxb, out, lse, do, None, scale, D_V, c),
            [
                {},
                dict(dqg_BLOCK_K=32, dqg_num_stages=3),
                dict(dqg_BLOCK_K=128, dqg_num_stages=1),
                dict(ds_BLOCK_K=32, ds_num_stages=2),
                dict(dqg_num_stages=1),
                gemm(64, 128, 64, 4, 3),
            ],
        )
        # the sweep only times: check the winner against the deterministic path (fixed-order dkv) on the same inputs
        ref = sparse_mla_bwd_triton(qb, kvb, idxb, out, lse, do, None, scale, D_V, deterministic=True)
        got = sparse_mla_bwd_triton(qb, kvb, idxb, out, lse, do, None, scale, D_V, bwd_cfg)
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
        print(f"verify bwd {bwd_cfg} vs deterministic: rel err dq {errs[0]:.2e} dkv {errs[1]:.2e}", flush=True)
        assert max(errs) < 1e-2, "swept backward config disagrees with the deterministic path"
        del q, kv, idx, out, lse, do
    for ctx in contexts:
        q, kv, idx = mla_inputs(ctx, n_fwd)
        ms = bench(lambda: sparse_mla_fwd_triton(q, kv, idx, scale, D_V, fwd_cfg))
        record("sparse_mla_fwd", "triton", ctx, ms, flops=fwd_flops, queries=n_fwd, config=fwd_cfg)
        if ctx == contexts[0]:
            ms = bench(lambda: torch_sparse_mla(q, kv, idx, scale), rep_ms=300)
            record("sparse_mla_fwd", "torch", ctx, ms, flops=fwd_flops, queries=n_fwd)
        qb, idxb = q[:, :n_bwd].contiguous(), idx[:, :n_bwd].contiguous()
        out, lse = sparse_mla_fwd_triton(qb, kv, idxb, scale, D_V)
        do = torch.randn_like(out)
        ms = bench(lambda: sparse_mla_bwd_triton(qb, kv, idxb, out, lse, do, None, scale, D_V, bwd_cfg), rep_ms=300)
        record("sparse_mla_bwd", "triton", ctx, ms, flops=bwd_flops, queries=n_bwd, config=bwd_cfg)
        if hopper_bwd_supports(qb, kv, idxb, D_V) is None:  # the Gluon pass 1, then the same dq and dkv kernels
            hop = lambda: sparse_mla_bwd_triton(qb, kv, idxb, out, lse, do, None, scale, D_V, bwd_cfg, pass1="hopper")
            errs = [
                rel_err(a, b)
                for a, b in zip(hop(), sparse_mla_bwd_triton(qb, kv, idxb, out, lse, do, None, scale, D_V, bwd_cfg))
            ]
            assert max(errs) < 1e-2, f"the Hopper pass 1 disagrees with the portable one: {errs}"
            record(
                "sparse_mla_bwd",
                "hopper pass 1",
                ctx,
                bench(hop, rep_ms=300),
                flops=bwd_flops,
                queries=n_bwd,
                rel_err_vs_triton=max(errs),
            )
            g = torch.empty(n_bwd, 2 * H, TOPK, device="cuda", dtype=qb.dtype)
            nk = key_extent(idxb, ctx)
            p1 = lambda: launch_hopper_ds(qb, kv, idxb, nk, do, out, lse, None, g, None, 0, n_bwd, scale)
            record(
                "sparse_mla_bwd pass 1",
                "hopper",
                ctx,
                bench(p1, rep_ms=300),
                flops=2 * H * TOPK * (D_QK + D_V) * n_bwd,
                queries=n_bwd,
            )
            del g, nk
        ms = bench(
            lambda: sparse_mla_bwd_triton(qb, kv, idxb, out, lse, do, None, scale, D_V, bwd_cfg, deterministic=True),
            rep_ms=300,
        )
        record("sparse_mla_bwd (deterministic)", "triton", ctx, ms, flops=bwd_flops, queries=n_bwd, config=bwd_cfg)
        del q, kv, idx, qb, idxb, out, lse, do


def bench_decode(contexts, do_sweep):
    scale = D_QK**-0.5
    for batch, t, h in [(64, 1, 128), (32, 2, 128), (128, 1, 16), (64, 2, 16)]:
        ctx = 32768
        q, kv, idx = mla_inputs(ctx, t, h=h, batch=batch, t_per_seq=t)
        nbytes = batch * t * TOPK * D_QK * 2 + q.numel() * 2 + batch * t * h * D_V * 2
        flops = 2 * h * TOPK * (D_QK + D_V) * batch * t
        ms = bench(lambda: sparse_mla_decode_triton(q, kv, idx, scale, D_V))
        record("sparse_mla_decode", "triton", ctx, ms, flops=flops, nbytes=nbytes, batch=batch, tokens=t, heads=h)
        if do_sweep and h < 64:  # h128 is compute-bound (the prefill kernel's loop); sweep the memory-bound case
            configs = [dict(num_splits=n) for n in (1, 2, 4)]  # more stages and a d_v split measured slower
            sweep(
                f"sparse_mla_decode b{batch} t{t} h{h}",
                lambda c: lambda: sparse_mla_decode_triton(q, kv, idx, scale, D_V, num_splits=c["num_splits"]),
                configs,
            )
        del q, kv, idx


def indexer_inputs(ctx, n_q, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, n_q, H_I, D_I, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, ctx, D_I, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(1, n_q, H_I, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(ctx - n_q, ctx, device="cuda").unsqueeze(0)
    return q, k, w, pos


def torch_indexer(q, k, w, pos, topk):
    """bf16 torch reference: per query chunk, logits einsum, relu, weighted head sum in fp32, torch.topk."""
    T, S = q.shape[1], k.shape[1]
    chunk = max(1, min(T, 2**31 // (H_I * S * 2)))
    out = torch.empty(1, T, topk, device=q.device, dtype=torch.int32)
    s_ar = torch.arange(S, device=q.device)
    for t0 in range(0, T, chunk):
        logits = torch.einsum("thd,sd->ths", q[0, t0 : t0 + chunk], k[0]).relu_()
        sc = torch.einsum("ths,th->ts", logits.float(), w[0, t0 : t0 + chunk].float())
        sc = sc.masked_fill(s_ar[None] > pos[0, t0 : t0 + chunk, None], float("-inf"))
        out[0, t0 : t0 + chunk] = topk_from_scores(sc.unsqueeze(0), topk)[0]
    return out


def unsorted_topk_then_sort(scores, topk):
    """torch.topk without a tie rule beside topk_from_scores' stable sort: unsorted select, then a sort of the topk
    survivors."""
    vals, idx = scores.topk(topk, dim=-1, sorted=False)
    vals, order = vals.sort(dim=-1, descending=True)
    idx = torch.gather(idx, -1, order)
    return torch.where(vals == float("-inf"), -1, idx).to(torch.int32)


def bench_indexer(contexts, do_sweep):
    n_q = 4096
    cfg = None
    if do_sweep:
        q, k, w, pos = indexer_inputs(32768, n_q)
        buf = torch.empty(1, n_q, 32768, device="cuda")
        cfg = sweep(
            "indexer_logits",
            lambda c: lambda: indexer_logits_triton(q, k, w, pos, buf, c),
            [
                {},
                dict(num_warps=8),
                dict(BLOCK_T=128, num_warps=8),
                dict(BLOCK_S=256, num_warps=8),
                dict(BLOCK_T=128, BLOCK_S=64),
                dict(BLOCK_T=128, BLOCK_S=256, num_warps=8, num_stages=2),
            ],
        )
        del q, k, w, pos, buf
    for ctx in contexts:
        q, k, w, pos = indexer_inputs(ctx, n_q)
        pairs = int(sum(range(ctx - n_q + 1, ctx + 1)))
        flops = 2 * H_I * D_I * pairs
        chunk = query_chunk(1, n_q, ctx)
        buf = torch.empty(1, chunk, ctx, device="cuda")
        qc, wc, pc = q[:, :chunk], w[:, :chunk], pos[:, -chunk:]
        ms = bench(lambda: indexer_logits_triton(qc, k, wc, pc, buf, cfg))
        chunk_pairs = int(sum(range(ctx - chunk + 1, ctx + 1)))
        record(
            "indexer_logits",
            "triton",
            ctx,
            ms,
            flops=2 * H_I * D_I * chunk_pairs,
            nbytes=chunk * ctx * 4,
            queries=chunk,
            config=cfg,
        )
        ms = bench(lambda: topk_from_scores(buf, TOPK))
        record("indexer_topk_only", "naive stable sort", ctx, ms, nbytes=chunk * ctx * 4, queries=chunk)
        ms = bench(lambda: unsorted_topk_then_sort(buf, TOPK))
        record(
            "indexer_topk_only",
            "fp32 topk(sorted=False)+sort, no tie rule",
            ctx,
            ms,
            nbytes=chunk * ctx * 4,
            queries=chunk,
        )
        ms = bench(lambda: indexer_topk_triton(q, k, w, pos, TOPK, overrides=cfg), rep_ms=300)
        record("indexer_logits+topk", "triton logits + radix select", ctx, ms, flops=flops, queries=n_q)
        ms = timed_slow(lambda: torch_indexer(q, k, w, pos, TOPK))
        record("indexer_logits+topk", "torch", ctx, ms, flops=flops, queries=n_q)
        del q, k, w, pos, buf


def bench_dense(contexts):
    for ctx in contexts:
        q = torch.randn(1, H, ctx, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, H, ctx, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, H, ctx, 128, device="cuda", dtype=torch.bfloat16)
        flops = 2 * H * (ctx * (ctx + 1) // 2) * (192 + 128)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        ms = bench(fn, rep_ms=300) if ctx <= 32768 else timed_slow(fn, n=2)
        record("dense_causal_sdpa", "torch sdpa", ctx, ms, flops=flops, queries=ctx)
        del q, k, v


def kernel_stats():
    """Registers, spills and shared memory of every compiled variant of the benchmarked kernels."""
    from dsaflow.ops.indexer_topk import triton_indexer
    from dsaflow.ops.sparse_mla import triton_backward, triton_decode, triton_prefill, triton_probs, triton_probs_add

    stats = []
    for fn in (
        triton_prefill._sparse_mla_fwd_kernel,
        triton_backward._sparse_mla_bwd_ds_kernel,
        triton_backward._sparse_mla_bwd_dq_gemm_kernel,
        triton_backward._sparse_mla_bwd_dkv_gemm_kernel,
        triton_backward._sparse_mla_bwd_dkv_reduce_kernel,
        triton_probs_add._probs_into_kernel,
        triton_probs._sparse_mla_probs_kernel,
        triton_decode._combine_kernel,
        triton_indexer._indexer_logits_kernel,
    ):
        try:
            for cache in fn.device_caches.values():
                for key, k in cache[0].items():
                    stats.append(
                        dict(
                            kernel=fn.__name__,
                            n_regs=k.n_regs,
                            n_spills=k.n_spills,
                            shared=k.metadata.shared,
                            num_warps=k.metadata.num_warps,
                            num_stages=k.metadata.num_stages,
                            key=str(key)[-160:],
                        )
                    )
        except Exception as e:  # the cache layout is a Triton internal; report rather than fail
            stats.append(dict(kernel=fn.__name__, error=repr(e)[:200]))
    for s in stats:
        print("stats", json.dumps(s), flush=True)
    return stats


def markdown(meta) -> str:
    lines = [
        f"# bench_ops ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Ceilings measured here: bf16 8192^3 matmul {CEIL['matmul_tflops']} TFLOP/s, "
        f"device copy {CEIL['copy_tbps']} TB/s (read + write).",
        "",
        "| kernel | impl | context | shape | time ms | TFLOP/s | % matmul | TB/s | % copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        if r["impl"] == "sweep":
            continue
        shape = ", ".join(f"{k}={r[k]}" for k in ("queries", "batch", "tokens", "heads") if k in r)
        lines.append(
            f"| {r['kernel']} | {r['impl']} | {r['context']} | {shape} | {r['time_ms']:.3f} | "
            f"{r.get('tflops', '')} | {'' if 'frac_matmul' not in r else round(100 * r['frac_matmul'], 1)} | "
            f"{r.get('tbps', '')} | {'' if 'frac_copy' not in r else round(100 * r['frac_copy'], 1)} |"
        )
    lines += peers_markdown()
    lines += ["", "Sweeps (ms at 32K; the target pass's at the first context):", ""]
    lines += [f"- {r['kernel']} {r['config']}: {r['time_ms']}" for r in ROWS if r["impl"] == "sweep"]
    return "\n".join(lines)


def main(argv=None, prog: str = "bench_ops.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default="mla,peers,decode,indexer,dense")
    args = ap.parse_args(argv)
    need_cuda(prog)
    contexts = [int(c) for c in args.contexts.split(",")]
    out = out_dir(prog, args.out)
    e = environment()
    meta = dict(device=e["device_name"], torch=e["torch"], triton=e["triton"])
    t0 = time.time()
    only = args.only.split(",")
    measure_ceilings()
    sections = (
        ("mla", bench_sparse_mla),
        ("peers", bench_backward_peers),
        ("decode", bench_decode),
        ("indexer", bench_indexer),
        ("dense", bench_dense),
    )
    for name, fn in sections:
        if name not in only:
            continue
        try:  # one failing section must not lose the others' numbers
            fn(contexts, not args.no_sweep) if name != "dense" else fn(contexts)
        except Exception as e:
            print(f"SECTION {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            ROWS.append(dict(kernel=name, impl="FAILED", context=None, time_ms=float("nan"), error=str(e)[:300]))
        torch.cuda.empty_cache()
    meta["seconds"] = round(time.time() - t0, 1)
    stats = kernel_stats()
    data = dict(meta=meta, ceilings=CEIL, rows=ROWS, peers=PEERS, kernel_stats=stats)
    write_results(out, "bench_ops", data, markdown(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
