"""One pipeline stage of DeepSeek-V3.2 attention at long context, under each `train.recompute` mode, on one GPU:
step time, throughput, model FLOP rate, measured peak memory and the planner's estimate of it.

    python scripts/bench_train.py stage --seq 16384,32768,65536,131072 --recompute none,attention,block \
        --out bench_out

Model: `model=dsv32` attention and indexer shapes (dim 7168, 128 heads, q_lora 1536, kv_lora 512 + rope 64,
indexer 64 x 128, topk 2048) with a 2048-wide MLP and a byte vocabulary; `--layers` layers (default 8: one stage of
a pp8 split) with `--index` roles (default every4 = FSSSFSSS), the embedding and the head. One step = what the
trainer runs for one microbatch of one sequence: forward and backward under bf16 autocast (the indexer loss inside
the backward), then both fused AdamW updates.

Each row: step_s (median over --reps steps after one warm-up step, CUDA-synchronised), tokens_per_s, tflops (model
FLOPs of the step: 6 per non-embedding parameter per token + sparse attention + indexer scores and loss,
dsaflow.plan.estimates.train_flops_per_token), peak_gib (torch.cuda.max_memory_allocated over the timed steps),
estimate_gib (the plan's training peak, dsaflow.plan.memory, with its terms) and estimate_error (estimate / measured
- 1). A row that runs out of memory is recorded as such and the sweep goes on.

Writes bench_train_stage.json and bench_train_stage.md into --out.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from bench_lib import describe_device, need_cuda, out_dir, wall_seconds, write_results

MODES = ("none", "attention", "block")


def model_overrides(moe_experts: int) -> list:
    """A 2048-wide dense MLP (moe_experts 0), or V3.2's MoE MLP (8 experts per token of width 2048, one shared) with
    `moe_experts` routed experts in one group, in every layer."""
    if not moe_experts:
        return ["model.inter_dim=2048", "model.moe=null"]
    return [
        f"model.moe.n_routed_experts={moe_experts}",
        "model.moe.n_group=1",
        "model.moe.topk_group=1",
        "model.moe.first_k_dense=0",
    ]


def plan_for(layers: int, index: str, seq: int, recompute: str, chunk_tokens: int = 16384, moe_experts: int = 0):
    """(cfg, plan) of one row: the plan carries the training-memory estimate."""
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan

    cfg = compose(
        [
            "model=dsv32",
            "model.vocab_size=256",
            *model_overrides(moe_experts),
            f"model.num_layers={layers}",
            f"model.max_seq_len={max(seq, 4096)}",
            f"index={index}",
            f"train.seq_len={seq}",
            f"train.recompute={recompute}",
            f"train.recompute_chunk_tokens={chunk_tokens}",
            "train.batch_size=1",
            "pipeline.microbatches=1",
        ]
    )
    return cfg, build_plan(cfg)


def build(layers: int, index: str, moe_experts: int = 0):
    """(stage on cuda in train mode, its two fused AdamW optimisers, as the trainer builds them). The weights do
    not depend on the sequence length or the recompute mode, so one stage serves every row."""
    return stage_and_optimisers(*plan_for(layers, index, 4096, "none", moe_experts=moe_experts))


def stage_and_optimisers(cfg, plan):
    """Stage 0 of `plan` on cuda in train mode and its two fused AdamW optimisers (main, indexer), as the trainer."""
    from dsaflow.pipeline.stages import stage_module

    stage = stage_module(cfg.model, plan, 0, seed=0).cuda().train()
    idx = stage.indexer_parameters()
    main = [p for p in stage.parameters() if all(p is not q for q in idx)]
    opts = [torch.optim.AdamW(main, lr=1e-5, fused=True), torch.optim.AdamW(idx, lr=1e-5, fused=True)]
    return stage, opts


def make_step(stage, opts, x):
    """The trainer's step for one microbatch: autocast around forward and backward (as around schedule.step), the
    loss head in chunks of the default train.loss_chunk_tokens on next-token targets."""
    from dsaflow.config.schema import TrainConfig
    from dsaflow.model import IndexerLossInBackward

    sink = IndexerLossInBackward(1.0)
    stage.head_in_loss = True
    target = x.roll(-1, dims=1)

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        sink.values.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage(x, indexer_loss_in_backward=sink)
            stage.lm_loss(out, target, TrainConfig.loss_chunk_tokens)[0].backward()
        for o in opts:
            o.step()

    return step


def measure(
    stage,
    opts,
    layers: int,
    index: str,
    seq: int,
    recompute: str,
    reps: int,
    chunk_tokens: int = 16384,
    moe_experts: int = 0,
) -> dict:
    """One row (see the module docstring) on the stage and optimisers of `build(layers, index)`."""
    from dsaflow.train.metrics import model_flops_per_token, peak_tflops_per_rank

    cfg, plan = plan_for(layers, index, seq, recompute, chunk_tokens, moe_experts)
    se = plan.estimates["stages"][0]
    row = {
        "moe_experts": moe_experts,
        "seq": seq,
        "layers": layers,
        "index": index,
        "recompute": recompute,
        "roles": "".join(l.role for l in plan.layers),
        "estimate_gib": se["train_peak_bytes"] / 2**30,
        "estimate_terms_gib": {k: v / 2**30 for k, v in se["train_memory_bytes"].items()},
    }
    n = sum(p.numel() for p in stage.parameters())
    flops = model_flops_per_token(cfg.model, plan, seq, n, stage.embed.weight.numel()) * seq
    stage.recompute, stage.recompute_chunk_tokens = recompute, chunk_tokens
    gc.collect()
    torch.cuda.empty_cache()
    try:
        x = torch.randint(0, 256, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        step = make_step(stage, opts, x)
        step()  # warm-up; the first row's also creates the optimiser state
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step_s = wall_seconds(step, "cuda", reps, warmup=False)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
        return row
    finally:
        for o in opts:
            o.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    row["step_s"] = step_s
    row["tokens_per_s"] = seq / row["step_s"]
    row["model_tflop"] = flops / 1e12
    row["tflops"] = flops / row["step_s"] / 1e12  # active FLOPs: a MoE layer counts the experts a token runs
    peak = peak_tflops_per_rank(cfg.train, torch.device("cuda"))
    row["mfu"] = row["tflops"] / peak if peak else None
    row["estimate_error"] = row["estimate_gib"] / row["peak_gib"] - 1
    return row


def markdown(rows: list, device: str) -> str:
    lines = [
        (
            f"Device: {device}. One stage of {rows[0]['layers']} layers, one sequence per step "
            f"(`python scripts/bench_train.py stage`)."
        ),
        "",
        "| experts | tokens | recompute | step | tokens/s | model TFLOP/s | MFU | peak (measured) | estimate | estimate error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r.get('moe_experts') or 'dense'} | {r['seq'] // 1024}K | {r['recompute']} |"
        est = f"{r['estimate_gib']:.1f} GiB" if "estimate_gib" in r else "-"
        if "error" in r:
            lines.append(f"{head} out of memory | | | | | {est} | |")
            continue
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "-"
        lines.append(
            f"{head} {r['step_s']:.2f} s | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {mfu} | "
            f"{r['peak_gib']:.1f} GiB | {est} | {100 * r['estimate_error']:+.1f} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None, prog="bench_train.py stage") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="16384,32768,65536,131072", help="tokens per microbatch, comma-separated")
    ap.add_argument("--recompute", default=",".join(MODES), help="train.recompute modes, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--index", default="every4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=16384, help="train.recompute_chunk_tokens")
    ap.add_argument(
        "--skip-after-oom",
        action="store_true",
        help="once a mode runs out of memory, record its longer sequences as out of memory unrun",
    )
    ap.add_argument(
        "--moe-experts", type=int, default=0, help="V3.2 MoE MLPs with this many routed experts (0: dense MLP)"
    )
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, args.out)
    seqs = [int(s) for s in args.seq.split(",")]
    modes = args.recompute.split(",")
    rows, failed = [], set()
    stage, opts = build(args.layers, args.index, args.moe_experts)
    for seq in seqs:
        for mode in modes:
            if args.skip_after_oom and mode in failed:
                rows.append(
                    {
                        "seq": seq,
                        "layers": args.layers,
                        "index": args.index,
                        "recompute": mode,
                        "error": "out of memory at a shorter sequence (not run)",
                    }
                )
                continue
            row = measure(
                stage, opts, args.layers, args.index, seq, mode, args.reps, args.chunk_tokens, args.moe_experts
            )
            if "error" in row:
                failed.add(mode)
            rows.append(row)
            print(json.dumps(row), flush=True)
    device = describe_device()
    write_results(out, "bench_train_stage", {"device": device, "rows": rows}, markdown(rows, device))
    return 0
