"""Benchmark the dense warm-up stage (DeepSeek-V3.2 recipe) at long context on one GPU.

1. One dense-phase training step of a V3.2-attention model (model=dsv32, byte vocab, 2048-wide MLP, 1-2 layers,
   one sequence, bf16 autocast) as the trainer runs it: forward with the main weights frozen and the dense indexer
   loss, then the indexer-loss backward (what the indexers learn from); step time and peak memory per context. One
   row at the largest context adds the LM-loss backward through trainable weights: what freezing them saves.
2. The dense indexer KL op alone at V3.2 shapes (128 heads x 192 for the target, 64 x 128 indexer): time of the
   attention-lse pass, the KL forward and the backward kernels, causal FLOPs and the rate against the measured bf16
   matmul ceiling; the chunked torch reference (the CPU path, the strongest O(T)-memory baseline) where it is fast
   enough to time.
Writes <out>/bench_dense_warmup.json and <out>/bench_dense_warmup.md (rewritten after every row).

    python scripts/bench_dense_warmup.py --out bench_out [--contexts 4096,8192,16384] [--layers 1,2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from bench_lib import bench, describe_device, measure_ceilings, need_cuda, out_dir, timed_slow, write_results

from dsaflow.ops.dense_indexer_kl import dense_indexer_kl_chunked
from dsaflow.ops.dense_indexer_kl.triton_launch import (
    _config,
    attn_lse_triton,
    kl_backward_triton,
    kl_forward_triton,
)

H, D, H_I, D_I = 128, 192, 64, 128
OUT = {"device": None, "ceilings": {}, "steps": [], "op": [], "errors": []}


def save(out, quiet: bool = True) -> None:
    lines = [
        f"# Dense warm-up on {OUT['device']}",
        "",
        f"bf16 matmul ceiling: {OUT['ceilings'].get('matmul_tflops')} TFLOP/s (8192^3)",
        "",
        "## Dense-phase training step (V3.2 attention, byte vocab, MLP 2048, batch 1)",
        "",
        "| layers | context | step ms | peak GiB | of which: forward ms | indexer-loss bwd ms | LM bwd ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in OUT["steps"]:
        lines.append(
            f"| {r['layout']} | {r['context']} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | {r['fwd_ms']:.1f} "
            f"| {r['idx_bwd_ms']:.1f} | {r['lm_bwd_ms']:.1f} |"
        )
    lines += [
        "",
        "## Dense indexer KL op (L served layers, 128x192 attention, 64x128 indexer, bf16, batch 1)",
        "",
        "| L | context | part | time ms | causal TFLOP | TFLOP/s | of matmul ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in OUT["op"]:
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
        fr = f"{r['frac_matmul']:.2f}" if r.get("frac_matmul") else "-"
        fl = f"{r['flops'] / 1e12:.2f}" if r.get("flops") else "-"
        lines.append(f"| {r['L']} | {r['context']} | {r['part']} | {r['time_ms']:.2f} | {fl} | {tf} | {fr} |")
    if OUT["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in OUT["errors"]]]
    write_results(out, "bench_dense_warmup", OUT, "\n".join(lines), quiet=quiet)


def model_step(layout: str, T: int, reps: int, frozen: bool = True) -> dict:
    """frozen=True: main weights requires_grad=False and no LM backward (the trainer's dense step,
    dsaflow/train/forward_pass.py); False: also the LM backward through trainable weights."""
    from dsaflow.config.compose import compose
    from dsaflow.pipeline.stages import stage_module
    from dsaflow.plan import build_plan

    cfg = compose(
        [
            "model=dsv32",
            "model.vocab_size=256",
            "model.inter_dim=2048",
            "model.moe=null",
            f"model.num_layers={len(layout)}",
            f"layout={layout}",
        ]
    )
    stage = stage_module(cfg.model, build_plan(cfg), 0).cuda().train()
    if frozen:
        for n, p in stage.named_parameters():
            p.requires_grad_(".attn.indexer." in n)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, T), generator=g).cuda()
    y = torch.randint(0, 256, (1, T), generator=g).cuda()
    times = []
    for i in range(reps + 1):
        stage.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == reps:  # the last step also measures peak memory (weights and gradients included)
            torch.cuda.reset_peak_memory_stats()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = stage(x, attn="dense", compute_indexer_loss=True)
        ev[1].record()
        idx_loss = stage.indexer_loss
        idx_loss.backward()  # each stage backpropagates its own indexer loss
        ev[2].record()
        if not frozen:
            F.cross_entropy(logits.view(T, -1), y.view(-1)).backward()  # the LM backward the trainer skips
        ev[3].record()
        torch.cuda.synchronize()
        times.append([ev[j].elapsed_time(ev[j + 1]) for j in range(3)])
    peak = torch.cuda.max_memory_allocated() / 2**30
    fwd, ib, lb = (sorted(t[j] for t in times[1:])[(reps - 1) // 2] if reps > 1 else times[-1][j] for j in range(3))
    del stage
    torch.cuda.empty_cache()
    return dict(
        layout=layout + ("" if frozen else " + LM backward"),
        context=T,
        step_ms=fwd + ib + lb,
        fwd_ms=fwd,
        idx_bwd_ms=ib,
        lm_bwd_ms=lb,
        peak_gib=peak,
        indexer_loss=float(idx_loss),
    )


def op_inputs(L: int, T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(L, 1, T, H, D, device="cuda", dtype=bf, generator=g)
    k = torch.randn(L, 1, T, H, D, device="cuda", dtype=bf, generator=g)
    q_i = (torch.randn(1, T, H_I, D_I, device="cuda", generator=g) * D_I**-0.5).to(bf)
    k_i = torch.randn(1, T, D_I, device="cuda", dtype=bf, generator=g)
    w = torch.randn(1, T, H_I, device="cuda", dtype=bf, generator=g)
    pos = torch.arange(T, device="cuda").view(1, T)
    return q, k, q_i, k_i, w, pos


def op_rows(L: int, T: int, chunked_max: int) -> None:
    q, k, q_i, k_i, w, pos = op_inputs(L, T)
    scale = D**-0.5
    cfg = _config(T, T, D, D_I, None)
    pairs = T * (T + 1) / 2  # causal (query, key) pairs
    att, idx = 2 * pairs * L * H * D, 2 * pairs * H_I * D_I  # one q.k pass over the target / one indexer dot pass
    lse = attn_lse_triton(q, k, pos, scale, cfg)
    kl, lse_i = kl_forward_triton(q, k, lse, q_i, k_i, w, pos, scale, cfg)
    coef = torch.full((1, T), 1.0 / T, device="cuda")
    parts = {
        "attention lse": (lambda: attn_lse_triton(q, k, pos, scale, cfg), att),
        "KL forward": (lambda: kl_forward_triton(q, k, lse, q_i, k_i, w, pos, scale, cfg), att + idx),
        "KL backward": (
            lambda: kl_backward_triton(q, k, lse, q_i, k_i, w, pos, lse_i, coef, scale, cfg),
            att + 4 * idx,
        ),
    }
    total_ms, total_fl = 0.0, 0.0
    ceil = OUT["ceilings"]["matmul_tflops"]
    for name, (fn, fl) in parts.items():
        ms = bench(fn, rep_ms=100 if T <= 8192 else 60, warmup_ms=25)
        total_ms, total_fl = total_ms + ms, total_fl + fl
        OUT["op"].append(
            dict(
                L=L,
                context=T,
                part=name,
                time_ms=ms,
                flops=fl,
                tflops=fl / ms / 1e9,
                frac_matmul=fl / ms / 1e9 / ceil,
            )
        )
    OUT["op"].append(
        dict(
            L=L,
            context=T,
            part="Triton total (fwd + bwd)",
            time_ms=total_ms,
            flops=total_fl,
            tflops=total_fl / total_ms / 1e9,
            frac_matmul=total_fl / total_ms / 1e9 / ceil,
        )
    )
    OUT["op"][-1]["loss"] = float(kl.sum() / T)
    if T <= chunked_max:  # the torch baseline: the chunked reference, forward + backward
        qi, ki, wi = (t.detach().requires_grad_(True) for t in (q_i, k_i, w))

        def ref():
            loss = dense_indexer_kl_chunked(q, k, scale, qi, ki, wi, pos)
            torch.autograd.grad(loss, (qi, ki, wi))
            return loss

        ref_loss = ref()
        ms = timed_slow(ref, 1)
        OUT["op"].append(
            dict(
                L=L,
                context=T,
                part="torch chunked reference (fwd + bwd)",
                time_ms=ms,
                flops=total_fl,
                tflops=total_fl / ms / 1e9,
                frac_matmul=total_fl / ms / 1e9 / ceil,
                loss=float(ref_loss),
            )
        )
        OUT["op"][-1]["loss_rel_diff_vs_triton"] = abs(float(ref_loss) - float(kl.sum() / T)) / float(ref_loss)


def main(argv=None, prog: str = "bench_dense_warmup.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--layouts", default="FS,F", help="model layouts of the training step (FS: one F + one S layer)")
    ap.add_argument("--op-layers", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chunked-max", type=int, default=4096, help="largest context for the torch reference")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip the remaining rows past this wall time")
    a = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, a.out)
    t_start = time.time()
    OUT["device"] = describe_device()
    OUT["ceilings"] = measure_ceilings()
    contexts = [int(c) for c in a.contexts.split(",")]
    jobs = [("step", lay, T) for lay in a.layouts.split(",") for T in sorted(contexts, reverse=True)]
    jobs += [("op", int(L), T) for L in a.op_layers.split(",") for T in contexts]
    jobs.sort(key=lambda j: (j[2] != max(contexts), j[0] != "step"))  # the 16K bar first, then the rest
    jobs.insert(len(a.layouts.split(",")), ("with_lm_bwd", a.layouts.split(",")[0], max(contexts)))
    for kind, arg, T in jobs:
        if time.time() - t_start > a.budget_s:
            OUT["errors"].append(f"skipped {kind} {arg} {T}: past --budget-s")
            continue
        try:
            if kind in ("step", "with_lm_bwd"):
                OUT["steps"].append(model_step(arg, T, a.reps, frozen=kind == "step"))
            else:
                op_rows(arg, T, a.chunked_max)
        except Exception as e:  # keep what was measured (one call to the device): record and go on
            OUT["errors"].append(f"{kind} {arg} {T}: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
            torch.cuda.empty_cache()
        save(out)
        print(json.dumps({"kind": kind, "arg": arg, "T": T, "s": round(time.time() - t_start, 1)}), flush=True)
    save(out, quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
