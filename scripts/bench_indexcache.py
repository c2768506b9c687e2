"""IndexCache benchmark: prefill time, the indexer's share of it, and decode tokens/s for all-F, 1/2-F and 1/4-F.

    python3 scripts/bench_indexcache.py --out bench_out/indexcache              # V3.2 attention, 8 layers, 8K..128K
    python3 scripts/bench_indexcache.py --device cpu --model tiny --layers 4 --contexts 48,96 --prefill-chunk 32 \
        --decode-steps 2 --extra "" --out /tmp/ic                                # CPU smoke test (no graphs)

Model: `model=dsv32` attention (128 heads, MLA 512 + 64, indexer 64 x 128, topk 2048) with --layers layers, a
2048-wide MLP and a 256-token vocab (--extra), bf16, one sequence, one process, one stage. Weights are random
normal(0, init_std) drawn on the device (their values do not change the work; the seeded CPU init would take
minutes at this size). For every index config (index=all_full / every2 / every4) and context L:

* prefill = the serving engine's chunked prefill (`PipelineEngine.generate`, --prefill-chunk tokens per chunk
  through the stage with its serving cache, which is how the engine prefills and keeps every sparse-attention call
  under 65,535 queries), from the engine's own timer; the cache is sized for exactly L + 127 tokens;
* decode = --decode-steps steps after that prefill with the stage's decode step replayed from a CUDA graph
  (graphs=decode, batch 1), tokens/s = steps / decode time;
* indexer share = (F layers) x (the indexer op alone on that prefill's chunks: same q / k / positions shapes,
  random inputs) / prefill time: an isolated-op estimate;
* dense baselines, once per context (--sdpa-repeats at contexts <= 32K): the dense model = the same layers' prefill
  with dense attention (one forward of all L tokens, no cache: every projection and MLP as in the DSA prefill,
  causal SDPA over the non-absorbed heads, no indexer), the like-for-like baseline; and causal SDPA alone (H heads,
  qk nope + rope, v head dim: 128 / 192 / 128 for V3.2) at L queries over L keys, times the number of layers.

Writes indexcache.json, indexcache.md and (matplotlib permitting) indexcache.png with the IndexCache paper's 1/4-F
ratios beside ours. The paper (H100, a 30B DSA model): prefill 1.27 / 1.31 / 1.51 / 1.82x and decode 1.24 / 1.33 /
1.40 / 1.48x at 10K / 60K / 120K / 200K; the indexer's share of prefill 27 % -> 81 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from bench_lib import environment, out_dir, resolve_device, wall_seconds, write_results

import dsaflow.model.stage as stage_mod
from dsaflow.config.compose import compose
from dsaflow.ops.indexer_topk import indexer_topk
from dsaflow.pipeline.stages import stage_module
from dsaflow.plan import build_plan
from dsaflow.serve.engine import PipelineEngine
from dsaflow.serve.generate import serve_dtype

PAPER = {
    "contexts": [10_000, 60_000, 120_000, 200_000],
    "prefill_1_4": [1.27, 1.31, 1.51, 1.82],
    "decode_1_4": [1.24, 1.33, 1.40, 1.48],
    "indexer_share_prefill": [0.27, 0.81],
    "setup": "IndexCache paper: H100, 30B DSA model, 1/4 of layers F",
}
INDEXES = {"all_full": 1, "every2": 2, "every4": 4}


def parse_args(argv=None, prog: str = "bench_indexcache.py"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dsv32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--extra", default="model.vocab_size=256 model.inter_dim=2048 model.moe=null", help="more config overrides"
    )
    ap.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    ap.add_argument("--indexes", default="all_full,every2,every4")
    ap.add_argument("--prefill-chunk", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="timed generate calls per context (median)")
    ap.add_argument("--sdpa-repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--out", default="bench_out/indexcache")
    a = ap.parse_args(argv)
    a.device = resolve_device(prog, a.device)
    return a


timed = wall_seconds  # median wall seconds of fn() between device syncs, after one untimed call


@torch.no_grad()
def fast_init(stage, seed: int, std: float) -> None:
    """Random normal(std) matrices, unit norms, drawn where the parameters live (the device)."""
    torch.manual_seed(seed)
    for p in stage.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.fill_(1.0)


def make_cfg(a, index: str, ctx: int, graphs: bool):
    over = [
        "mode=serve",
        "track=none",
        f"model={a.model}",
        f"model.num_layers={a.layers}",
        *a.extra.split(),
        f"index={index}",
        "pipeline.stages=1",
        "serve.max_batch=1",
        f"serve.max_new_tokens={a.decode_steps + 1}",
        f"serve.max_context={ctx + 127}",
        f"serve.prefill_chunk={min(a.prefill_chunk, ctx)}",
        "graphs=decode" if graphs else "graphs=off",
    ]
    cfg = compose(over)
    if graphs:
        cfg.graphs.blocks[0].shape_classes = [1]
    return cfg, build_plan(cfg)


def build_stage(cfg, plan, device, dtype):
    original = stage_mod.init_stage_weights
    stage_mod.init_stage_weights = fast_init
    try:
        with torch.device(device):
            st = stage_module(cfg.model, plan, 0, seed=cfg.train.seed)
    finally:
        stage_mod.init_stage_weights = original
    return st.to(dtype=dtype).eval()


@torch.no_grad()
def indexer_op_seconds(m, ctx: int, chunk: int, device, dtype, repeats: int = 1) -> float:
    """The indexer op alone over one layer's prefill, in the model's indexer precision (`model.index_fp8`): every
    chunk's queries against the serving cache's keys (median of `repeats` per chunk)."""
    S = ctx + 128
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(1, S, m.index_head_dim, device=device, generator=g).to(dtype)
    total = 0.0
    for c0 in range(0, ctx, chunk):
        t = min(chunk, ctx - c0)
        q = torch.randn(1, t, m.index_n_heads, m.index_head_dim, device=device, generator=g).to(dtype)
        w = torch.randn(1, t, m.index_n_heads, device=device, generator=g).to(dtype)
        pos = torch.arange(c0, c0 + t, device=device).unsqueeze(0)
        total += timed(lambda: indexer_topk(q, k, w, pos, m.index_topk, fp8=m.index_fp8), device, repeats)
    return total


@torch.no_grad()
def dense_model_seconds(stage, ctx: int, device, repeats: int) -> float:
    """The same stage as a dense-attention model: one forward of `ctx` tokens with attn="dense" and no cache (causal
    SDPA over the non-absorbed heads, O(T) memory; no indexer runs)."""
    x = torch.randint(
        0, stage.cfg.vocab_size, (1, ctx), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    return timed(lambda: stage(x, attn="dense"), device, repeats)


@torch.no_grad()
def sdpa_seconds(m, ctx: int, device, dtype, repeats: int) -> float:
    """Dense causal attention alone for one layer: H heads, qk nope + rope, v head dim, L queries over L keys."""
    H, dqk, dv = m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    q = torch.randn(1, H, ctx, dqk, device=device, dtype=dtype)
    k = torch.randn(1, H, ctx, dqk, device=device, dtype=dtype)
    v = torch.randn(1, H, ctx, dv, device=device, dtype=dtype)
    f = torch.nn.functional.scaled_dot_product_attention
    return timed(lambda: f(q, k, v, is_causal=True), device, repeats)


def run(a) -> dict:
    device = torch.device(a.device)
    dtype = serve_dtype("auto", device)
    graphs = device.type == "cuda"
    contexts = [int(c) for c in a.contexts.split(",")]
    rows, base = [], {}
    gen = torch.Generator().manual_seed(0)
    for index in a.indexes.split(","):
        cfg0, plan0 = make_cfg(a, index, contexts[0], graphs)
        m = cfg0.model
        stage = build_stage(cfg0, plan0, device, dtype)
        n_f = sum(1 for layer in stage.layers.values() if layer.attn.indexer is not None)
        for ctx in contexts:
            cfg, plan = make_cfg(a, index, ctx, graphs)
            eng = PipelineEngine(cfg.model, plan, {0: stage}, cfg.serve, cfg.graphs, device, dtype, 0, None)
            eng.capture()
            # warm-up: one full prefill chunk, so every kernel specialization of the timed run compiles here
            eng.generate([torch.randint(0, m.vocab_size, (min(ctx, a.prefill_chunk),), generator=gen).tolist()])
            prompt = torch.randint(0, m.vocab_size, (ctx,), generator=gen).tolist()
            pre, dec = [], []
            for _ in range(a.repeats):
                eng.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
                eng.generate([prompt])
                pre.append(eng.timings["prefill_s"])
                dec.append(eng.timings["decode_s"] / max(1, eng.timings["decode_steps"]))
            del eng
            if ctx not in base:
                reps = a.sdpa_repeats if ctx <= 32768 else 1
                base[ctx] = dict(
                    indexer_s=indexer_op_seconds(m, ctx, min(a.prefill_chunk, ctx), device, dtype),
                    sdpa_layer_s=sdpa_seconds(m, ctx, device, dtype, reps),
                    dense_model_s=dense_model_seconds(stage, ctx, device, reps),
                )
            prefill_s, step_s = statistics.median(pre), statistics.median(dec)
            row = dict(
                index=index,
                f_layers=n_f,
                layers=a.layers,
                context=ctx,
                prefill_ms=prefill_s * 1e3,
                prefill_tokens_per_s=ctx / prefill_s,
                decode_ms_per_token=step_s * 1e3,
                decode_tokens_per_s=1.0 / step_s,
                indexer_ms=n_f * base[ctx]["indexer_s"] * 1e3,
                indexer_share=n_f * base[ctx]["indexer_s"] / prefill_s,
                dense_sdpa_ms=a.layers * base[ctx]["sdpa_layer_s"] * 1e3,
                dense_model_ms=base[ctx]["dense_model_s"] * 1e3,
                decode_graphs=graphs,
            )
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            save(result(a, rows, device, dtype), Path(a.out), final=False)  # a cut-off run keeps its rows
        del stage
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result(a, rows, device, dtype)


def result(a, rows: list, device, dtype) -> dict:
    """Rows with the ratios to all-F at the same context and to dense SDPA, plus the environment and the paper."""
    full = {r["context"]: r for r in rows if r["index"] == "all_full"}
    for r in rows:
        f = full.get(r["context"])
        r["prefill_speedup_vs_all_f"] = f["prefill_ms"] / r["prefill_ms"] if f else None
        r["decode_speedup_vs_all_f"] = r["decode_tokens_per_s"] / f["decode_tokens_per_s"] if f else None
        r["vs_dense_sdpa"] = r["dense_sdpa_ms"] / r["prefill_ms"]
        r["vs_dense_model"] = r["dense_model_ms"] / r["prefill_ms"]
    env = dict(
        device=environment(device)["device_name"],
        torch=torch.__version__,
        model=a.model,
        extra=a.extra,
        layers=a.layers,
        prefill_chunk=a.prefill_chunk,
        repeats=a.repeats,
        dtype=str(dtype),
        decode_steps=a.decode_steps,
        batch=1,
    )
    return dict(env=env, rows=rows, paper=PAPER)


def save(res: dict, out: Path, final: bool = True) -> None:
    """indexcache.json and .md (after every row: a cut-off run keeps its rows), and the plot at the end."""
    write_results(out, "indexcache", res, markdown(res), (lambda plt: plot(res, plt)) if final else None, not final)


def ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(res: dict) -> str:
    e = res["env"]
    lines = [
        f"# IndexCache: prefill and decode vs the share of F layers ({e['device']})",
        "",
        f"`model={e['model']}` attention, {e['layers']} layers, `{e['extra']}`, {e['dtype']}, batch 1; prefill "
        f"in {e['prefill_chunk']}-token chunks through the serving engine; decode {e['decode_steps']} steps "
        f"(CUDA graphs: {res['rows'][0]['decode_graphs'] if res['rows'] else '-'}). Indexer share: the op alone "
        f"on the same shapes x F layers / prefill. Dense model: the same layers with dense attention (causal SDPA), "
        f"one forward; dense SDPA: causal attention alone x layers. A ratio > 1 means DSA is faster.",
        "",
        "| index | F layers | context | prefill ms | speedup vs all-F | indexer ms (share) | dense model ms "
        "| dense model / DSA | dense SDPA ms | SDPA / DSA | decode tokens/s | decode speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['index']} | {r['f_layers']} | {r['context']} | {r['prefill_ms']:.1f} | "
            f"{ratio(r['prefill_speedup_vs_all_f'])} | {r['indexer_ms']:.1f} ({r['indexer_share'] * 100:.0f} %) "
            f"| {r['dense_model_ms']:.1f} | {r['vs_dense_model']:.2f}x "
            f"| {r['dense_sdpa_ms']:.1f} | {r['vs_dense_sdpa']:.2f}x | {r['decode_tokens_per_s']:.1f} | "
            f"{ratio(r['decode_speedup_vs_all_f'])} |"
        )
    p = res["paper"]
    lines += [
        "",
        f"{p['setup']}: prefill {' / '.join(f'{x}x' for x in p['prefill_1_4'])}, decode "
        f"{' / '.join(f'{x}x' for x in p['decode_1_4'])} at {' / '.join(f'{c // 1000}K' for c in p['contexts'])}; "
        f"indexer share of prefill {p['indexer_share_prefill'][0] * 100:.0f} % -> "
        f"{p['indexer_share_prefill'][1] * 100:.0f} %.",
        "",
    ]
    return "\n".join(lines)


def plot(res: dict, plt):
    """The paper's 1/4-F ratios beside ours, and the indexer's share of prefill -> the figure."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    p = res["paper"]
    for ax, key, paper_key, title in (
        (axes[0], "prefill_speedup_vs_all_f", "prefill_1_4", "prefill speedup vs all-F"),
        (axes[1], "decode_speedup_vs_all_f", "decode_1_4", "decode speedup vs all-F"),
    ):
        for index in dict.fromkeys(r["index"] for r in res["rows"]):
            if index == "all_full":
                continue
            rs = [r for r in res["rows"] if r["index"] == index]
            ax.plot([r["context"] / 1000 for r in rs], [r[key] for r in rs], "o-", label=f"ours, {index}")
        ax.plot([c / 1000 for c in p["contexts"]], p[paper_key], "s--", color="gray", label="paper, 1/4 F (H100)")
        ax.set(title=title, xlabel="context (K tokens)", ylabel="x")
        ax.legend(fontsize=7)
    for index in dict.fromkeys(r["index"] for r in res["rows"]):
        rs = [r for r in res["rows"] if r["index"] == index]
        axes[2].plot([r["context"] / 1000 for r in rs], [100 * r["indexer_share"] for r in rs], "o-", label=index)
    axes[2].set(title="indexer share of prefill (%)", xlabel="context (K tokens)")
    axes[2].legend(fontsize=7)
    fig.suptitle(
        f"IndexCache on {res['env']['device']}, {res['env']['model']} attention x {res['env']['layers']} layers",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def main(argv=None, prog: str = "bench_indexcache.py") -> int:
    a = parse_args(argv, prog)
    save(run(a), out_dir(prog, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
