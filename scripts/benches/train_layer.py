"""Where a training step's time goes, per layer x microbatch, for a model with DeepSeek-V3.2 attention on one GPU.

    python scripts/bench_train.py layer --seq 4096,16384 --layers 4 --out bench_out
    python scripts/bench_train.py layer --seq 131072 --layers 2 --impls fused --no-profile --recompute attention \
        --out bench_out   # 128K

Model: `model=dsv32` attention and indexer (dim 7168, 128 heads, q_lora 1536, kv_lora 512 + rope 64, indexer 64 x 128,
topk 2048) with a 2048-wide MLP and a byte vocabulary, `--layers` layers in one stage (embedding, layers, head),
`--index` roles (default every4 = FSSS...). One step = forward + backward of one sequence (one microbatch) under bf16
autocast + both AdamW updates. For each sequence length and indexer-loss implementation (`fused`: what the trainer
runs: the KL kernels inside the backward, on the target the sparse-attention backward fills; `fused_forward`: the
same kernels with the target recomputed in the forward by its own kernel; `naive`: the fp32 PyTorch reference in the
forward, the baseline without kernels):

  step_ms, tokens_per_s        median wall time of a step (CUDA-synchronised) and seq / step time
  no_loss_ms, indexer_loss_ms  the same step without the indexer loss, and the difference (the loss's cost)
  model_tflop, rate, mfu       training FLOPs of the step (6N + sparse attention + indexer scores + indexer loss:
                               dsaflow.plan.estimates.train_flops_per_token), FLOP/s, and its fraction of the bf16
                               8192^3 matmul ceiling measured in the same process
  per layer x microbatch (ms)  from a torch.profiler trace of one step, kernel time by kind: matmuls, indexer
                               (logits + top-k), sparse attention forward / backward, indexer loss, everything else
  peak_mem_gib, static_gib     peak device memory of the step, and weights + optimiser state alone

Writes bench_train_layer.json and bench_train_layer.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_lib import describe_device, measure_ceilings, need_cuda, out_dir, wall_seconds, write_results

KINDS = ("matmul", "indexer", "attn_fwd", "attn_bwd", "indexer_loss", "other")
# Kernel-name fragments (lower case) -> kind, first match wins. Triton kernels carry their Python names.
PATTERNS = (
    ("indexer_loss", ("indexer_kl", "attention_target", "attn_target", "_kl_", "probs_into", "sparse_mla_probs")),
    # cuDNN-Frontend's CuTe DSL kernels carry their class names (FlashAttentionDSABackwardSm90 and its pre- and
    # postprocess), next to "cutlass", which would otherwise count them as matmuls
    ("attn_bwd", ("sparse_mla_bwd", "attentiondsabackward")),
    ("attn_fwd", ("sparse_mla_fwd", "sparse_mla_hopper", "hopper_fwd", "seesaw_fwd")),
    ("indexer", ("indexer_logits", "topk", "radix", "select", "sort")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, frags in PATTERNS:
        if any(f in low for f in frags):
            return kind
    return "other"


def build(layers: int, index: str, seq: int, recompute: str = "none"):
    from benches.train_stage import plan_for, stage_and_optimisers
    from dsaflow.train.metrics import model_flops_per_token

    cfg, plan = plan_for(layers, index, seq, recompute)
    stage, opts = stage_and_optimisers(cfg, plan)
    stage.recompute = recompute
    n = sum(p.numel() for p in stage.parameters())
    flops = model_flops_per_token(cfg.model, plan, seq, n, stage.embed.weight.numel()) * seq
    return cfg, plan, stage, opts, flops


def make_step(stage, opts, x, with_loss: bool, in_backward: bool = True):
    from dsaflow.model import IndexerLossInBackward, attach_aux_loss

    sink = IndexerLossInBackward(1.0)

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        sink.values.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if with_loss and in_backward:
                out = stage(x, indexer_loss_in_backward=sink)
            else:
                out = stage(x, compute_indexer_loss=with_loss)
        if with_loss and stage.indexer_loss is not None:
            out = attach_aux_loss(out, stage.indexer_loss)
        stage.indexer_loss = None
        out.float().logsumexp(-1).mean().backward()
        for o in opts:
            o.step()

    return step


def time_step(step, reps: int) -> float:
    """Median wall ms of a step (CUDA-synchronised), after one untimed step."""
    return wall_seconds(step, "cuda", reps) * 1e3


def profile_kinds(step) -> tuple[dict, list]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_kind = {k: 0.0 for k in KINDS}
    other = {}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0.0)
        if not dev_us or ev.key.startswith("ProfilerStep"):
            continue
        if getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        kind = kind_of(ev.key)
        per_kind[kind] += dev_us / 1e3
        if kind == "other":
            other[ev.key] = other.get(ev.key, 0.0) + dev_us / 1e3
    top_other = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    return per_kind, top_other


def set_impl(impl: str) -> None:
    """fused: the op's CUDA kernels; naive: the fp32 reference (the pre-kernel path) on CUDA tensors."""
    os.environ["DSAFLOW_INDEXER_LOSS"] = "reference" if impl == "naive" else "auto"


IMPLS = ("fused", "fused_forward", "naive")


def run_case(
    seq: int, layers: int, index: str, impl: str, reps: int, profile: bool, ceiling: float, recompute: str = "none"
) -> dict:
    set_impl(impl)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg, plan, stage, opts, flops = build(layers, index, seq, recompute)
    x = torch.randint(0, 256, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    row = {
        "seq": seq,
        "layers": layers,
        "index": index,
        "impl": impl,
        "roles": "".join(l.role for l in plan.layers),
        "recompute": recompute,
    }
    try:
        full = make_step(stage, opts, x, True, in_backward=impl == "fused")
        full()  # creates the optimiser state
        torch.cuda.synchronize()
        row["static_gib"] = sum(p.numel() * p.element_size() * 3 for p in stage.parameters()) / 2**30
        torch.cuda.reset_peak_memory_stats()
        row["step_ms"] = time_step(full, reps)
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["no_loss_ms"] = time_step(make_step(stage, opts, x, False), reps)
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
        return row
    finally:
        set_impl("fused")
    row["indexer_loss_ms"] = row["step_ms"] - row["no_loss_ms"]
    row["indexer_loss_share"] = row["indexer_loss_ms"] / row["step_ms"]
    row["tokens_per_s"] = seq / (row["step_ms"] / 1e3)
    row["model_tflop"] = flops / 1e12
    row["tflops"] = flops / (row["step_ms"] / 1e3) / 1e12
    row["mfu_of_measured_matmul"] = row["tflops"] / ceiling
    if profile:
        set_impl(impl)
        kinds, top_other = profile_kinds(full)
        set_impl("fused")
        row["per_layer_mb_ms"] = {k: v / layers for k, v in kinds.items()}
        row["top_other_kernels_ms"] = top_other
    del stage, opts
    return row


def markdown(rows: list, ceiling: float, device: str) -> str:
    lines = [
        f"Device: {device}; bf16 8192^3 matmul ceiling measured here: {ceiling:.0f} TFLOP/s.",
        "",
        "| seq | layers (roles) | recompute | indexer loss | step ms | tokens/s | no-loss ms | indexer loss share | model TFLOP/step "
        "| TFLOP/s | of matmul ceiling | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['seq']} | {r['layers']} ({r['roles']}) | {r['recompute']} | {r['impl']} | {r['error']} |||||||||"
            )
            continue
        lines.append(
            f"| {r['seq']} | {r['layers']} ({r['roles']}) | {r['recompute']} | {r['impl']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['no_loss_ms']:.1f} | {100 * r['indexer_loss_share']:.1f}% | {r['model_tflop']:.2f} | {r['tflops']:.0f} | "
            f"{100 * r['mfu_of_measured_matmul']:.1f}% | {r['peak_mem_gib']:.1f} |"
        )
    prof = [r for r in rows if "per_layer_mb_ms" in r]
    if prof:
        lines += [
            "",
            "Per layer x microbatch (one sequence), kernel time by kind (ms, torch.profiler):",
            "",
            "| seq | indexer loss | " + " | ".join(KINDS) + " | sum |",
            "|---|---|" + "---|" * (len(KINDS) + 1),
        ]
        for r in prof:
            k = r["per_layer_mb_ms"]
            lines.append(
                f"| {r['seq']} | {r['impl']} | "
                + " | ".join(f"{k[x]:.2f}" for x in KINDS)
                + f" | {sum(k.values()):.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None, prog="bench_train.py layer") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="4096,16384")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--index", default="every4")
    ap.add_argument("--impls", default="fused,fused_forward,naive", help=f"comma-separated, of {IMPLS}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--recompute",
        default="none",
        choices=["none", "attention", "block"],
        help="train.recompute: attention = keep only the attention inputs, recompute in backward",
    )
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    bad = set(args.impls.split(",")) - set(IMPLS)
    if bad:
        ap.error(f"--impls {args.impls}: {sorted(bad)} unknown, use {', '.join(IMPLS)}")
    need_cuda(prog)
    out = out_dir(prog, args.out)
    ceiling = measure_ceilings()["matmul_tflops"]
    device = describe_device()
    rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        for impl in args.impls.split(","):
            row = run_case(seq, args.layers, args.index, impl, args.reps, not args.no_profile, ceiling, args.recompute)
            print(json.dumps({k: v for k, v in row.items() if k != "top_other_kernels_ms"}), flush=True)
            rows.append(row)
    data = {"device": device, "matmul_tflops": ceiling, "rows": rows}
    write_results(out, "bench_train_layer", data, markdown(rows, ceiling, device))
    return 0
