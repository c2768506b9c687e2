"""Benchmark the fused indexer-loss ops against the fp32 torch reference at DeepSeek-V3.2 shapes (CUDA only).

Shapes: one sequence of 4096 tokens, every token a query, causal top-2048 indices (queries before position 2047 see
fewer keys: -1 padding), MLA 128 heads x 576 (512 latent + 64 rope), indexer 64 heads x 128, bf16 inputs.
Sections:
  ops   the attention target (one layer; a group of 1 and 4 served layers accumulated into one buffer), the KL
        forward and forward + backward, the same through the torch reference in the same process, and the Triton
        sparse-MLA forward + backward at the same shapes for scale. A short config sweep picks the kernels' configs;
        the winners are checked against the reference.
  step  one training step (bf16 autocast forward + backward of LM loss + indexer loss) of a stage of V3.2-attention
        layers (dim 7168, 2048-wide MLP, byte vocab) with layouts F and FSSS: indexer loss off, fused, reference.
        The indexer loss's share of the step = (step with it - step without it) / step with it.
Writes <out>/bench_indexer_loss.json and <out>/bench_indexer_loss.md (after every section).

    python scripts/bench_indexer_loss.py --out bench_out [--no-sweep] [--only ops,step]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from bench_lib import CEIL, add_rates, environment, measure_ceilings, need_cuda, out_dir, write_results
from bench_lib import bench as harness_bench
from bench_lib import timed_slow as harness_timed_slow

from dsaflow.ops.indexer_loss import (
    attention_distribution,
    attention_target_naive,
    index_scores_on_keys,
    indexer_kl_loss,
    indexer_kl_naive,
)
from dsaflow.ops.indexer_loss.function import indexer_kl_triton
from dsaflow.ops.indexer_loss.triton_target import attention_target_triton
from dsaflow.ops.sparse_mla import sparse_mla

SEQ, H, D_QK, D_V, TOPK, H_I, D_I = 4096, 128, 576, 512, 2048, 64, 128
SM_SCALE = 192**-0.5
DEV, DT = "cuda", torch.bfloat16
ROWS: list[dict] = []
CHOSEN: dict = {"target": None, "kl": None}


def bench(fn, rep_ms=200) -> float:
    return harness_bench(fn, rep_ms=rep_ms, device=DEV)


def timed_slow(fn, n=3) -> float:
    return harness_timed_slow(fn, n if DEV == "cuda" else 1, device=DEV)


def record(section, what, impl, ms, flops=None, **extra):
    row = add_rates(
        dict(section=section, what=what, impl=impl, time_ms=round(ms, 3), flops=flops, **extra), ms, CEIL, flops
    )
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure_ceiling():
    measure_ceilings(DEV)  # into bench_lib.CEIL, which every row's fraction reads


def causal_topk(T, S, K, g):
    """int32 [1, T, K]: K random visible keys per query (query t at position S - T + t), -1 where fewer exist."""
    pos = torch.arange(S - T, S, device=DEV).view(T, 1)
    scores = torch.rand(T, S, device=DEV, generator=g).masked_fill(torch.arange(S, device=DEV) > pos, -1.0)
    vals, idx = scores.topk(K, dim=-1)
    return torch.where(vals >= 0, idx, -1).to(torch.int32).unsqueeze(0)


def sweep(name, make_fn, configs):
    best = None
    for cfg in configs:
        try:
            ms = bench(make_fn(cfg), 150)
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(f"sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        print(f"sweep {name} {cfg}: {ms:.3f} ms", flush=True)
        ROWS.append(dict(section="sweep", what=name, impl="triton", config=cfg, time_ms=round(ms, 3)))
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best[0] if best else {}


def bench_ops(do_sweep):
    g = torch.Generator(device=DEV).manual_seed(0)
    idx = causal_topk(SEQ, SEQ, TOPK, g)
    n_valid_pairs = int((idx >= 0).sum())
    layers = []
    for _ in range(4):  # an F layer and 3 served S layers: own q / kv / lse, shared indices
        q = (torch.randn(1, SEQ, H, D_QK, device=DEV, generator=g) * 0.5).to(DT)
        kv = torch.randn(1, SEQ, D_QK, device=DEV, generator=g).to(DT)
        with torch.no_grad():
            _, lse = sparse_mla(q, kv, idx, SM_SCALE, D_V)
        layers.append((q, kv, lse))
    q, kv, lse = layers[0]
    t_flops = 2 * H * TOPK * D_QK * SEQ  # per layer, nominal K (the valid pairs are `valid_frac` of it)
    extra = dict(queries=SEQ, topk=TOPK, valid_frac=round(n_valid_pairs / (SEQ * TOPK), 3))

    tcfg = {}
    if do_sweep:
        tcfg = sweep(
            "attention_target",
            lambda c: lambda: attention_target_triton(q, kv, idx, lse, SM_SCALE, overrides=c),
            [
                {},
                dict(BLOCK_K=32, num_stages=3),
                dict(num_warps=8),
                dict(BLOCK_K=128, num_warps=8),
                dict(BLOCK_H=128, BLOCK_K=32, num_warps=8),
                dict(BLOCK_H=128, BLOCK_K=16, num_warps=8),
            ],
        )
    CHOSEN["target"] = tcfg
    ref = attention_distribution(q, kv, idx, lse, SM_SCALE)
    got = attention_target_triton(q, kv, idx, lse, SM_SCALE, overrides=tcfg)
    err = rel(got, ref)
    print(f"target rel err vs reference: {err:.2e}", flush=True)
    assert err < 1e-3, "fused target disagrees with the reference"
    ms = bench(lambda: attention_target_triton(q, kv, idx, lse, SM_SCALE, overrides=tcfg))
    record("ops", "attention target, 1 layer", "triton", ms, t_flops, rel_err=err, config=tcfg, **extra)
    ms = timed_slow(lambda: attention_distribution(q, kv, idx, lse, SM_SCALE))
    record("ops", "attention target, 1 layer", "torch fp32 reference", ms, t_flops, **extra)
    del ref, got

    for n in (1, 4):
        grp = layers[:n]

        def fused_group():
            out = torch.zeros(1, SEQ, TOPK, device=DEV)
            for ql, kvl, lsel in grp:
                attention_target_triton(ql, kvl, idx, lsel, SM_SCALE, out=out, weight=1 / n, overrides=tcfg)
            return out

        def torch_group():  # the previous recorder: one distribution per layer, then a stacked mean
            return torch.stack([attention_distribution(ql, kvl, idx, lsel, SM_SCALE) for ql, kvl, lsel in grp]).mean(0)

        record("ops", f"attention target, group of {n} layers", "triton", bench(fused_group), n * t_flops, **extra)
        record(
            "ops",
            f"attention target, group of {n} layers",
            "torch fp32 reference",
            timed_slow(torch_group, 2),
            n * t_flops,
            **extra,
        )
        if n == 4:
            target = fused_group()
            err = rel(target, torch_group())
            print(f"group-of-4 target rel err vs reference: {err:.2e}", flush=True)

    qi = torch.randn(1, SEQ, H_I, D_I, device=DEV, generator=g).to(DT)
    ki = torch.randn(1, SEQ, D_I, device=DEV, generator=g).to(DT)
    wi = (torch.randn(1, SEQ, H_I, device=DEV, generator=g) * (H_I * D_I) ** -0.5).to(DT)
    qa, ka, wa = (x.clone().requires_grad_(True) for x in (qi, ki, wi))
    kl_flops = 2 * H_I * TOPK * D_I * SEQ

    def fused_fb(c):
        return lambda: torch.autograd.grad(indexer_kl_triton(qa, ka, wa, idx, target, c), (qa, ka, wa))

    kcfg = {}
    if do_sweep:
        bwd = sweep(
            "indexer_kl fwd+bwd (bwd configs)",
            lambda c: fused_fb({"bwd": c}),
            [
                {},
                dict(BLOCK_K=32, num_warps=4),
                dict(BLOCK_K=32, num_warps=8, num_stages=3),
                dict(BLOCK_K=128, num_warps=8),
            ],
        )
        fwd = sweep(
            "indexer_kl fwd",
            lambda c: lambda: indexer_kl_triton(qi, ki, wi, idx, target, {"fwd": c}),
            [
                {},
                dict(BLOCK_K=128, num_warps=8),
                dict(BLOCK_K=64, num_warps=4),
            ],
        )
        kcfg = {"fwd": fwd, "bwd": bwd}
    CHOSEN["kl"] = kcfg
    with torch.no_grad():
        ms = bench(lambda: indexer_kl_triton(qi, ki, wi, idx, target, kcfg))
    record("ops", "indexer KL forward", "triton", ms, kl_flops, config=kcfg.get("fwd"), **extra)
    ms = bench(fused_fb(kcfg))
    record("ops", "indexer KL forward + backward", "triton", ms, 4 * kl_flops, config=kcfg, **extra)
    qr, kr, wr = (x.float().requires_grad_(True) for x in (qi, ki, wi))
    with torch.no_grad():
        ms = timed_slow(lambda: indexer_kl_loss(index_scores_on_keys(qr, kr, wr, idx), target))
    record("ops", "indexer KL forward", "torch fp32 reference", ms, kl_flops, **extra)
    ref_fb = lambda: torch.autograd.grad(indexer_kl_naive(qr, kr, wr, idx, target), (qr, kr, wr))  # noqa: E731
    ms = timed_slow(ref_fb, 2)
    record("ops", "indexer KL forward + backward", "torch fp32 reference", ms, 4 * kl_flops, **extra)
    loss, ref_loss = indexer_kl_triton(qa, ka, wa, idx, target, kcfg), indexer_kl_naive(qr, kr, wr, idx, target)
    errs = dict(loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    for name, a, b in zip("qkw", torch.autograd.grad(loss, (qa, ka, wa)), torch.autograd.grad(ref_loss, (qr, kr, wr))):
        errs["d" + name] = rel(a, b)
    print("KL rel errs vs reference:", {k: f"{v:.2e}" for k, v in errs.items()}, flush=True)
    ROWS.append(
        dict(
            section="check",
            what="indexer KL vs reference (bf16 inputs)",
            impl="triton",
            **{k: float(f"{v:.3g}") for k, v in errs.items()},
        )
    )

    # Sparse MLA forward + backward at the same shapes (the attention the target distils), for scale.
    qs, kvs = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    d_out = torch.randn(1, SEQ, H, D_V, device=DEV, generator=g).to(DT)

    def mla_fb():
        out, _ = sparse_mla(qs, kvs, idx, SM_SCALE, D_V)
        return torch.autograd.grad(out, (qs, kvs), d_out)

    mla_flops = 2 * H * TOPK * SEQ * ((D_QK + D_V) + (2 * D_QK + 2 * D_V))
    record("ops", "sparse MLA forward + backward (for scale)", "triton", bench(mla_fb, 300), mla_flops, **extra)


def v32_stage(layout: str, seed: int = 0):
    from dsaflow.config.schema import ModelConfig
    from dsaflow.model import build_model

    cfg = ModelConfig(
        name="dsv32-attn",
        num_layers=len(layout),
        dim=7168,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_rope_head_dim=64,
        index_topk=TOPK,
        inter_dim=2048,
        vocab_size=256,
        max_seq_len=SEQ,
        init_std=0.006,
    )
    if DEV == "cpu":  # --smoke: the tiny model
        cfg = ModelConfig(num_layers=len(layout), index_topk=TOPK, max_seq_len=SEQ)
    return build_model(cfg, layout, seed).to(DEV).train()


def bench_step(layouts):
    import dsaflow.model.indexer_loss as recorder_mod
    from dsaflow.ops.indexer_loss import attention_target, indexer_kl

    def fused_target(q, kv, indices, lse, sm_scale, out=None, weight=1.0):  # the sweep's configs
        if not q.is_cuda:
            return attention_target(q, kv, indices, lse, sm_scale, out, weight)
        return attention_target_triton(q, kv, indices, lse, sm_scale, out, weight, CHOSEN["target"])

    def fused_kl(q, k, w, indices, target):
        return (
            indexer_kl_triton(q, k, w, indices, target, CHOSEN["kl"])
            if q.is_cuda
            else indexer_kl(q, k, w, indices, target)
        )

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, SEQ), generator=g).to(DEV)
    y = torch.randint(0, 256, (1, SEQ), generator=g).to(DEV)
    for layout in layouts:
        stage = v32_stage(layout)
        times = {}
        for mode in ("off", "fused", "torch fp32 reference"):
            ref = mode == "torch fp32 reference"
            recorder_mod.attention_target = attention_target_naive if ref else fused_target
            recorder_mod.indexer_kl = indexer_kl_naive if ref else fused_kl

            def step():
                stage.zero_grad(set_to_none=True)
                with torch.autocast(DEV, dtype=DT, enabled=DEV == "cuda"):
                    logits = stage(x, compute_indexer_loss=mode != "off")
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
                if stage.indexer_loss is not None:
                    loss = loss + stage.indexer_loss
                loss.backward()

            if DEV == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times[mode] = timed_slow(step, 3)
            share = None if mode == "off" else round((times[mode] - times["off"]) / times[mode], 3)
            record(
                "step",
                f"train step, layout {layout}",
                mode,
                times[mode],
                layers=len(layout),
                ms_per_layer=round(times[mode] / len(layout), 2),
                indexer_loss_share=share,
                config=None if mode == "off" or ref else CHOSEN,
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEV == "cuda" else None,
            )
        recorder_mod.attention_target, recorder_mod.indexer_kl = attention_target, indexer_kl
        del stage
        torch.cuda.empty_cache()


def write(out, meta, quiet=True):
    lines = [
        f"# Indexer-loss kernels ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"bf16 matmul ceiling {CEIL.get('matmul_tflops')} TFLOP/s; seq {SEQ}, topk {TOPK}, MLA {H} x {D_QK}, "
        f"indexer {H_I} x {D_I}. Configs: {CHOSEN}",
        "",
        "| section | what | impl | time (ms) | TFLOP/s | of matmul ceiling | indexer-loss share | peak GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in ROWS:
        if r["section"] in ("ops", "step"):
            lines.append(
                f"| {r['section']} | {r['what']} | {r['impl']} | {r['time_ms']} | {r.get('tflops', '')} | "
                f"{r.get('frac_matmul', '')} | {r.get('indexer_loss_share', '') or ''} | "
                f"{r.get('peak_gib', '')} |"
            )
    checks = [r for r in ROWS if r["section"] == "check"]
    if checks:
        lines += ["", "Checks: " + "; ".join(json.dumps(c) for c in checks)]
    data = dict(meta=meta, ceilings=CEIL, chosen=CHOSEN, rows=ROWS)
    write_results(out, "bench_indexer_loss", data, "\n".join(lines), quiet=quiet)


def main(argv=None, prog: str = "bench_indexer_loss.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default="ops,step")
    ap.add_argument("--layouts", default="F,FSSS")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): logic check only")
    args = ap.parse_args(argv)
    if args.smoke:
        global SEQ, H, D_QK, D_V, TOPK, H_I, D_I, SM_SCALE, DEV, DT
        SEQ, H, D_QK, D_V, TOPK, H_I, D_I, SM_SCALE, DEV, DT = 24, 4, 40, 32, 8, 4, 16, 40**-0.5, "cpu", torch.float32
    else:
        need_cuda(prog)
    out = out_dir(prog, args.out)
    e = environment(DEV)
    meta = dict(device=e["device_name"], torch=e["torch"], triton=e["triton"])
    t0 = time.time()
    measure_ceiling()
    sections = [("ops", lambda: bench_ops(not args.no_sweep)), ("step", lambda: bench_step(args.layouts.split(",")))]
    for name, fn in sections:
        if name not in args.only.split(","):
            continue
        try:  # one failing section must not lose the other's numbers
            fn()
        except Exception as e:
            print(f"SECTION {name} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            ROWS.append(dict(section="failed", what=name, impl="", time_ms=float("nan"), error=str(e)[:400]))
        torch.cuda.empty_cache()
        meta["seconds"] = round(time.time() - t0, 1)
        write(out, meta)
    write(out, meta, quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
