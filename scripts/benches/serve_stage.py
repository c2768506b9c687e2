"""One pp8 serving stage of DeepSeek-V3.2 at its real shapes on one GPU, FP8 weights resident: prefill and decode
tokens/s, measured peak memory against the planner's, and each GEMM family's rate against the FP8 ceiling.

    python scripts/bench_serve.py stage --out bench_out                          # 8 MoE layers, FP8, one H200
    python scripts/bench_serve.py stage --weights bf16 --layers 2 --out bench_out  # the bf16 comparison row
    python scripts/bench_serve.py stage --device cpu --model tiny_moe --first-layer 1 --layers 2 --prefill 64 \
        --decode-rows 2 --decode-context 32 --chunk 32 --out /tmp/stage            # a CPU smoke run

The stage: layers --first-layer .. + --layers of `model=<--model>` (default layers 8-15 of dsv32: 8 MoE layers,
every one F as V3.2's index pattern has it), --experts routed experts (default the model's 256), no embedding and
no head (a middle stage). Its weights are random and made on the device in their stored format: e4m3 + 128x128
block scales for the FP8 policy's tensors (`--weights fp8`), never a bf16 copy of the stage; `--weights bf16` fills
bf16 instead. Graphs on: each timed pass is captured in a CUDA graph and replayed (on CPU: eager).

Rows (one cache per row, sized as the planner sizes it: serve.max_batch x (serve.max_context + 1) tokens):
  prefill  one sequence at context C (--prefill, default 8K, 32K, 128K): the stage forward over one --chunk-token
           chunk (default 8192, serve.prefill_chunk) at positions C - chunk .. C - 1 on the sparse path, the keys
           before it in the cache; tokens/s = chunk / time (the rate of the chunk that ends the prompt)
  decode   --decode-rows rows (default 64, 256), one token each at position --decode-context (default 8192) - 1
The cache's earlier rows are random (`fill_context_`), as a prefill of distinct tokens leaves them.
Decode rows also report weight_bytes_read (every weight of the stage but the routed experts, plus the experts the
routers picked for these rows) and of_weight_bound: those bytes over the copy rate, as a fraction of the pass's time.
Each row reports peak_gib (torch.cuda.max_memory_allocated from the stage's build through the row) against
plan_gib (dsaflow.plan.serve_memory: weights + KV and index caches + work buffers for that serve config) and
plan_error. The `gemms` rows time each GEMM family alone on the row's token count: attention projections (wq_a,
wq_b, wkv_a, wo), indexer projections (wq_b, wk), shared expert (w1, w3, w2) and routed experts (both grouped GEMMs
with their routing glue, uniform random routing), then all of them together as the layer runs them (one
quantization of each input the projections share), each replayed from a CUDA graph, as TFLOP/s and a fraction of
the fp8 ceiling (bench_fp8.py's `torch._scaled_mm` 8192^3) or, with bf16 weights, of the bf16 matmul ceiling.
`--kernels N` adds to each decode row its N most expensive kernels per pass (torch.profiler over the graph's
replays): where the time beyond the weight bytes goes. Writes bench_serve_stage.json and .md into --out.
"""

from __future__ import annotations

import argparse
import gc

import torch
from bench_lib import (
    CEIL,
    bench_graph,
    command_line,
    environment,
    fp8_ceiling,
    kernel_times,
    measure_ceilings,
    out_dir,
    resolve_device,
    timed_slow,
    write_results,
)

FP8 = torch.float8_e4m3fn


def compose_cfg(args, batch: int, context: int, chunk: int):
    from dsaflow.config.compose import compose

    over = [f"model={args.model}", f"model.num_layers={args.first_layer + args.layers}", "mode=serve"]
    over += [f"serve.weights={args.weights}", f"serve.max_batch={batch}", f"serve.max_context={context}"]
    over += [f"serve.prefill_chunk={chunk}", f"model.max_seq_len={max(context + 1, 4096)}", "track=none"]
    if args.experts:
        over += [f"model.moe.n_routed_experts={args.experts}", "model.moe.n_group=1", "model.moe.topk_group=1"]
    return compose(over)


@torch.no_grad()
def fill_random_(stage, std: float, seed: int = 0) -> None:
    """Random weights in each tensor's own format, on its device, a slice at a time (no bf16 copy of an FP8
    stack): e4m3 values of N(0, 1) with scales `std` (weights of std `std`), bf16 / fp32 ~ N(0, std), norms 1."""
    g = torch.Generator(device=next(stage.buffers()).device).manual_seed(seed)
    for name, t in stage.state_dict().items():
        if name.endswith("_scale_inv"):
            t.fill_(std)
        elif t.dim() == 1:
            t.fill_(0.0 if "bias" in name else 1.0)
        else:
            rows = t.view(-1, t.shape[-1])
            step = max(1, (1 << 26) // t.shape[-1])
            for r in range(0, rows.shape[0], step):
                part = torch.randn(rows[r : r + step].shape, device=t.device, generator=g)
                rows[r : r + step] = part if t.dtype == FP8 else part * std


def build_stage(cfg, args, device, dtype):
    """Layers first .. first + layers of the model, built on the meta device, converted to FP8 modules by the policy
    (--weights fp8), then given storage on `device` and random weights there."""
    from dsaflow.model.fp8_weights import materialize_, quantize_stage_
    from dsaflow.model.stage import StageModule
    from dsaflow.plan import build_plan

    plan = build_plan(cfg)
    specs = [plan.layers[i] for i in range(args.first_layer, args.first_layer + args.layers)]
    with torch.device("meta"):
        stage = StageModule(cfg.model, specs, is_first=False, is_last=False, name="bench stage")
    if args.weights == "fp8":
        quantize_stage_(stage, "meta", dtype)
    else:
        stage.to(dtype=dtype)
    materialize_(stage, device)
    fill_random_(stage, cfg.model.init_std)
    return stage.eval(), specs


def graphed(fn, device):
    """fn captured in a CUDA graph -> its replay (on CPU: fn). Warmed up on a side stream first, as torch asks."""
    if torch.device(device).type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def plan_bytes(cfg, specs) -> int:
    from dsaflow.plan.serve_memory import serve_memory_terms, serve_width

    width = serve_width(str(cfg.serve.dtype), "cuda")
    terms = serve_memory_terms(cfg, [s.role for s in specs], [s.index for s in specs], False, False, width)
    return sum(terms.values())


def time_ms(fn, device, reps: int) -> float:
    return timed_slow(fn, reps, device)


def gemm_ms(fn, device, reps: int) -> float:
    """Milliseconds of fn() replayed from a CUDA graph, as the stage's passes run (eager timing would add the host's
    launch latency before the first kernel, a visible part of a family that takes a fraction of a millisecond); on
    CPU: `time_ms`."""
    if torch.device(device).type != "cuda":
        return time_ms(fn, device, reps)
    return bench_graph(fn)


def fill_context_(cache, seed: int = 0) -> None:
    """Every cached latent row and indexer key standard normal, as a prefill of distinct tokens leaves them (kv_norm
    and the indexer's LayerNorm give rows of about unit scale). A zero cache would make every score tie: the top-k
    select's worst case (every key a candidate), not a served context's."""
    g = torch.Generator(device=next(iter(cache.kv.values())).device).manual_seed(seed)
    for t in (*cache.kv.values(), *cache.index_k.values()):
        t.normal_(generator=g)


def run_row(args, stage, specs, device, dtype, kind: str, batch: int, context: int, chunk: int) -> dict:
    """One prefill or decode row: a cache for (batch, context), the pass at the end of the context, timed."""
    from dsaflow.model.cache import StageCache

    cfg = compose_cfg(args, batch, context, chunk)
    T = chunk if kind == "prefill" else 1
    row = {"kind": kind, "rows": batch, "context": context, "tokens_per_pass": batch * T}
    cache = None
    try:
        cache = StageCache.allocate(cfg.model, specs, batch, context, batch * chunk, device, dtype)
        fill_context_(cache)
        x = torch.randn(batch, T, cfg.model.dim, device=device, dtype=dtype)
        positions = torch.arange(context - T, context, device=device).expand(batch, T).contiguous()

        run = stage.forward_prefill if kind == "prefill" else stage.forward_decode

        def step():
            with torch.no_grad():
                run(x, positions, cache)

        if kind == "decode":
            row["weight_bytes_read"] = decode_weight_bytes(stage, step)
        replay = graphed(step, device)
        ms = time_ms(replay, device, args.reps)
        if kind == "decode" and args.kernels:
            row["kernels"] = kernel_table(replay, device, args.kernels)
        row.update(time_ms=ms, tokens_per_s=batch * T / ms * 1e3)
        if kind == "decode" and CEIL.get("copy_tbps"):
            bound_ms = row["weight_bytes_read"] / (CEIL["copy_tbps"] * 1e12) * 1e3
            row.update(weight_bound_ms=bound_ms, of_weight_bound=bound_ms / ms)
        if torch.device(device).type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["plan_gib"] = plan_bytes(cfg, specs) / 2**30
        if "peak_gib" in row:
            row["plan_error"] = row["plan_gib"] / row["peak_gib"] - 1
        row["gemms"] = gemm_rows(stage, cfg, batch * T, device, dtype, args)
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    finally:
        del cache
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return row


def kernel_table(replay, device, top: int, passes: int = 5) -> list:
    """The `top` kernels of a pass by time, [{name, ms (per pass), calls (per pass)}], over `passes` replays
    (`bench_lib.kernel_times`: on CPU the aten ops of the eager pass): where a decode pass's time goes beyond its
    weight bytes."""
    replay()
    rows = kernel_times(replay, device, passes)[:top]
    return [{"name": name[:120], "ms": ms, "calls": calls} for name, ms, calls in rows]


def decode_weight_bytes(stage, step) -> int:
    """The weight bytes one decode pass must read: every tensor of the stage except the routed experts' stacks, plus,
    per MoE layer, the experts its router picked for these rows in one eager run of `step` (an expert no row picked
    is not read). Over the copy rate this is the decode pass's bound."""
    picked, hooks = {}, []
    for name, layer in stage.layers.items():
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, name=name: picked.__setitem__(name, out[0].unique().numel())))  # fmt: skip
    step()
    for h in hooks:
        h.remove()
    total = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
    for name, n_picked in picked.items():
        experts = stage.layers[name].mlp.experts
        stacks = sum(t.numel() * t.element_size() for t in experts.state_dict().values())
        total -= stacks - stacks * n_picked // experts.gate_up_proj.shape[0]
    return total


FAMILIES = {
    "attention projections": ("attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wo"),
    "indexer projections": ("attn.indexer.wq_b", "attn.indexer.wk"),
    "shared expert": ("mlp.shared_experts.w1", "mlp.shared_experts.w3", "mlp.shared_experts.w2"),
}


def gemm_rows(stage, cfg, M: int, device, dtype, args) -> dict:
    """{family: {time_ms, tflops, frac}} of one layer's GEMMs at M tokens (the first layer of the stage), each family
    alone, and "all GEMMs of the layer" run together as the layer runs them: the attention input x read by wq_a,
    wkv_a and the indexer's wk, the MLP input by the shared and the routed experts, each quantized once
    (`shared_fp8_input`); every other projection reads an input of its own width."""
    from dsaflow.ops.fp8_gemm import shared_fp8_input

    layer = next(iter(stage.layers.values()))
    D = cfg.model.dim
    x_attn, x_mlp = (torch.randn(M, D, device=device, dtype=dtype) for _ in range(2))
    other = {}  # one activation per other input width (q_latent, the attention output, the shared hidden)

    def run(mods, x, x_fp8=None):
        if x_fp8 is None:
            x_fp8 = shared_fp8_input(x, *(m.weight for m in mods if m.in_features == D))
        for m in mods:
            m((x if x_fp8 is None else x_fp8) if m.in_features == D else other.setdefault(m.in_features, torch.randn(
                M, m.in_features, device=device, dtype=dtype)))  # fmt: skip

    out, runs, total_flops = {}, [], 0
    for family, names in FAMILIES.items():
        mods = [layer.get_submodule(n) for n in names if _has(layer, n)]
        if not mods:
            continue
        x = x_mlp if family == "shared expert" else x_attn
        run(mods, x)  # the inputs exist before timing
        flops = sum(2 * M * m.in_features * m.out_features for m in mods)
        out[family] = _rate(gemm_ms(lambda mods=mods, x=x: run(mods, x), device, args.reps), flops, args)
        runs.append((mods, x))
        total_flops += flops
    moe = cfg.model.moe
    routed = None
    if moe is not None and _has(layer, "mlp.experts"):
        e, k, inter = moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_inter_dim
        g = torch.Generator(device=device).manual_seed(0)
        ids = torch.rand(M, e, device=device, generator=g).topk(k, dim=-1).indices
        weights = torch.full((M, k), 1.0 / k, device=device)
        flops = 2 * M * k * 3 * inter * D

        def routed(x_fp8=None):
            layer.mlp.experts(x_mlp, ids, weights, *(() if x_fp8 is None else (x_fp8,)))

        out["routed experts"] = _rate(gemm_ms(routed, device, args.reps), flops, args)
        total_flops += flops

    def every_gemm():
        attn = [m for mods, x in runs if x is x_attn for m in mods]
        mlp = [m for mods, x in runs if x is x_mlp for m in mods]
        # the routed experts and the shared expert read one quantization of x_mlp
        gate_up = [] if routed is None else [layer.mlp.experts.gate_up_proj]
        x_fp8 = shared_fp8_input(x_mlp, *gate_up, *(m.weight for m in mlp))
        if routed is not None:
            routed(x_fp8)
        run(mlp, x_mlp, x_fp8)
        run(attn, x_attn)

    out["all GEMMs of the layer"] = _rate(gemm_ms(every_gemm, device, args.reps), total_flops, args)
    return out


def _has(layer, name: str) -> bool:
    try:
        return layer.get_submodule(name) is not None
    except AttributeError:
        return False


def _rate(ms: float, flops: float, args) -> dict:
    tflops = flops / ms / 1e9
    ceiling = CEIL.get("fp8_tflops") if args.weights == "fp8" else CEIL.get("matmul_tflops")
    return {"time_ms": ms, "tflops": tflops, "frac_ceiling": tflops / ceiling if ceiling else None}


def markdown(rows: list, env: dict, args) -> str:
    lines = [
        f"Device: {env['device_name']}. `{env['command']}`: layers {args.first_layer}-"
        f"{args.first_layer + args.layers - 1} of {args.model}, {args.weights} weights, graphs "
        f"{'on' if env['graphs'] else 'off (CPU)'}; ceilings {env['ceilings']}.",
        "",
        "| pass | rows | context | tokens/s | ms | of weight-read bound | peak | plan | plan error | GEMM families "
        "(TFLOP/s, of ceiling) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['kind']} | {r['rows']} | {r['context']:,} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        fams = "; ".join(
            f"{k}: {v['tflops']:.1f}" + (f" ({100 * v['frac_ceiling']:.0f} %)" if v["frac_ceiling"] else "")
            for k, v in r["gemms"].items()
        )
        peak = f"{r['peak_gib']:.1f} GiB" if "peak_gib" in r else "-"
        err = f"{100 * r['plan_error']:+.1f} %" if "plan_error" in r else "-"
        bound = (
            f"{100 * r['of_weight_bound']:.0f} % ({r['weight_bytes_read'] / 2**30:.1f} GiB)"
            if "of_weight_bound" in r
            else "-"
        )
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['time_ms']:.2f} | {bound} | {peak} | {r['plan_gib']:.1f} GiB | "
            f"{err} | {fams} |"
        )
    for r in rows:
        if r.get("kernels"):
            lines += ["", f"Top kernels of the {r['rows']}-row decode pass (torch.profiler over 5 replays):", "",
                      "| kernel | ms per pass | calls per pass |", "|---|---:|---:|"]  # fmt: skip
            lines += [f"| `{k['name'][:80]}` | {k['ms']:.4f} | {k['calls']:g} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None, prog="bench_serve.py stage") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--model", default="dsv32", help="the model config (tiny_moe for a CPU smoke run)")
    ap.add_argument("--weights", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--first-layer", type=int, default=8, help="the stage's first layer (dsv32 pp8 stage 1: 8)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0: the model's)")
    ap.add_argument("--prefill", default="8192,32768,131072", help="prefill contexts, comma-separated")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens (serve.prefill_chunk)")
    ap.add_argument("--decode-rows", default="64,256", help="decode batch sizes, comma-separated")
    ap.add_argument("--decode-context", type=int, default=8192, help="each decode row's context")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=0, help="decode rows: list the top N kernels of a pass (profiler)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    device = resolve_device(prog, args.device)
    out = out_dir(prog, args.out)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    measure_ceilings(device)
    if device == "cuda" and args.weights == "fp8":
        CEIL["fp8_tflops"] = fp8_ceiling()
    torch.manual_seed(0)
    cfg = compose_cfg(args, 1, args.decode_context, args.chunk)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stage, specs = build_stage(cfg, args, device, dtype)
    rows = []
    for ctx in (int(c) for c in args.prefill.split(",") if c):
        rows.append(run_row(args, stage, specs, device, dtype, "prefill", 1, ctx, min(args.chunk, ctx)))
        print(rows[-1], flush=True)
    for b in (int(c) for c in args.decode_rows.split(",") if c):
        rows.append(run_row(args, stage, specs, device, dtype, "decode", b, args.decode_context, 1))
        print(rows[-1], flush=True)
    env = environment(device, command=command_line("bench_serve.py", ["stage", *(argv or [])]), ceilings=dict(CEIL))
    env["graphs"] = device == "cuda"
    data = {"environment": env, "args": vars(args), "rows": rows}
    write_results(out, "bench_serve_stage", data, markdown(rows, env, args))
    return 0
