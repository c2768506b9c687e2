"""The short-context rows of scripts/bench_indexcache.py (`--part short`): the DSA layer's prefill on the sparse path
and on the short path (dsaflow.model.dense_prefill) against an independent plain-torch dense layer, the indexer's
time and its key projection's, and the masked attention's measured rate against the sparse kernel's (MASKED_RATE,
from which `masked_max_keys` sets the crossover). See bench_indexcache.py's docstring for what each column means."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_lib import environment, write_results
from torch import nn

from dsaflow.model import dense_prefill
from dsaflow.model.dense_prefill import key_mask, masked_max_keys, plan_prefill
from dsaflow.model.rope import rope_angles
from dsaflow.ops.sparse_mla import sparse_mla
from dsaflow.pipeline.stages import stage_cache

LAYOUTS = ("all_full", "every4")  # index configs: FFFF and FSSS at 4 layers
UNBOUNDED = 1 << 62  # max_keys that forces the masked path above top-k (and min_tokens=2: any chunk)


# ---- the baseline: one dense MLA + SwiGLU layer in plain torch (nothing from dsaflow) ----
def _rms(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, cos, sin):
    """Half-split RoPE: x [..., T, d] with cos / sin [T, d // 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DenseLayer(nn.Module):
    """A pre-norm DeepSeek MLA layer with dense causal attention over the non-absorbed heads, and a SwiGLU MLP:
    x [1, L, dim] -> [1, L, dim]. q = [q_nope | rope q_pe] (N + R), k = [W_UK c | rope k_pe], v = W_UV c (V)."""

    def __init__(self, m):
        super().__init__()
        self.m, H = m, m.n_heads
        self.N, self.R, self.V, self.C = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.wq_a, self.wq_b = lin(m.dim, m.q_lora_rank), lin(m.q_lora_rank, H * (self.N + self.R))
        self.wkv_a, self.wkv_b = lin(m.dim, self.C + self.R), lin(self.C, H * (self.N + self.V))
        self.wo = lin(H * self.V, m.dim)
        self.w1, self.w3, self.w2 = lin(m.dim, m.inter_dim), lin(m.dim, m.inter_dim), lin(m.inter_dim, m.dim)
        self.norms = nn.ParameterList([nn.Parameter(torch.ones(d)) for d in (m.dim, m.q_lora_rank, self.C, m.dim)])

    def forward(self, x):
        B, L, _ = x.shape
        H, N, R, V, C, eps = self.m.n_heads, self.N, self.R, self.V, self.C, self.m.norm_eps
        ang = torch.arange(L, device=x.device).float().unsqueeze(-1) * self.m.rope_theta ** (
            -torch.arange(0, R, 2, device=x.device).float() / R
        )
        cos, sin = ang.cos(), ang.sin()
        h = _rms(x, self.norms[0], eps)
        q = self.wq_b(_rms(self.wq_a(h), self.norms[1], eps)).view(B, L, H, N + R).transpose(1, 2)
        c, k_pe = self.wkv_a(h).split([C, R], dim=-1)
        kv = self.wkv_b(_rms(c, self.norms[2], eps)).view(B, L, H, N + V).transpose(1, 2)
        k_nope, v = kv.split([N, V], dim=-1)
        q = torch.cat([q[..., :N], _rope(q[..., N:], cos, sin)], dim=-1)
        k_pe = _rope(k_pe, cos, sin).unsqueeze(1).expand(B, H, L, R)
        k = torch.cat([k_nope, k_pe], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(N + R) ** -0.5)
        x = x + self.wo(o.transpose(1, 2).reshape(B, L, H * V))
        h = _rms(x, self.norms[3], eps)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


# ---- the DSA layers ----
@torch.no_grad()
def stage_prefill_seconds(stage, cache, L: int, chunk: int, path: str, timed, device, repeats: int) -> float:
    """Prefill L tokens through `stage` with its serving cache in `chunk`-token chunks, on `path`: "sparse" (no hint),
    "short" (dense where every key fits top-k, else masked, whatever the crossover) or "auto" (what the serving
    engine runs eagerly: `plan_prefill` with the current rule, the split first chunk included)."""
    m = stage.cfg
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, m.vocab_size, (1, L), device=device, generator=g)
    chunks = []
    for c0, pos, hint in chunk_hints(m, cache, L, chunk, path):
        chunks.append((x[:, c0 : c0 + len(pos)], torch.tensor([pos], device=device), hint))

    def prefill():
        for xc, pc, hint in chunks:
            stage(xc, pc, cache, prefill=hint)

    if path == "auto_graph":  # one pass (chunk >= L), captured as the engine's prefill graph of its class would be
        if device.type != "cuda" or len(chunks) != 1:
            return None
        xc, pc, hint = chunks[0]
        return graph_seconds(lambda: stage(xc, pc, cache, prefill=hint), device, repeats)
    return timed(prefill, device, repeats)


def graph_seconds(fn, device, repeats: int) -> float:
    """Median seconds of one CUDA-graph replay of fn (captured after a warm-up on a side stream): the time without
    the launches' host overhead, as a captured serving pass runs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out = []
    for _ in range(max(1, repeats)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    del graph
    return sorted(out)[len(out) // 2]


def chunk_hints(m, cache, L: int, chunk: int, path: str) -> list:
    """[(first position, positions, hint)] of each chunk of an L-token prefill on `path` (stage_prefill_seconds)."""
    out = []
    for c0 in range(0, L, chunk):
        pos = list(range(c0, min(L, c0 + chunk)))
        hint = None
        if path == "auto_graph":
            path = "auto"
        if path == "short":
            hint = plan_prefill([pos], m.index_topk, cache.max_context + 1, UNBOUNDED, min_tokens=2)
        elif path == "auto":
            hint = plan_prefill([pos], m.index_topk, cache.max_context + 1, masked_max_keys(m))
        out.append((c0, pos, hint))
    return out


@torch.no_grad()
def indexer_seconds(layer, m, L: int, chunk: int, device, dtype, timed, op_seconds, repeats):
    """(indexer projections + its scores / top-k op, key projection alone) for L tokens, seconds."""
    idx = layer.attn.indexer
    x = torch.randn(1, L, m.dim, device=device, dtype=dtype)
    q_latent = torch.randn(1, L, m.q_lora_rank, device=device, dtype=dtype)
    rope = rope_angles(torch.arange(L, device=device).unsqueeze(0), m.index_rope_head_dim, m.rope_theta)
    proj = timed(lambda: idx(x, q_latent, rope), device, repeats)
    keys = timed(lambda: idx.keys(x, rope), device, repeats)
    return proj + op_seconds(m, L, chunk, device, dtype, repeats), keys


def run(a, make_cfg, build_stage, op_seconds, timed) -> dict:
    """The short rows: for every layout and context, the per-layer times and the bar; then the crossover."""
    from dsaflow.serve.generate import serve_dtype

    device = torch.device(a.device)
    dtype = serve_dtype("auto", device)
    contexts = [int(c) for c in a.short.split(",")]
    rows, base, sweep, rates = [], {}, [], []
    warm_up(device)
    short_args = argparse.Namespace(**{**vars(a), "layers": a.short_layers})
    for index in LAYOUTS:
        cfg, plan = make_cfg(short_args, index, max(contexts), graphs=False)
        m = cfg.model
        stage = build_stage(cfg, plan, device, dtype)
        n_f = sum(1 for layer in stage.layers.values() if layer.attn.indexer is not None)
        for L in contexts:
            chunk = min(a.prefill_chunk, L)
            cache = stage_cache(m, plan, 0, 1, L + 127, chunk, device, dtype)
            times = {
                p: stage_prefill_seconds(stage, cache, L, chunk, p, timed, device, a.short_repeats)
                for p in ("sparse", "short", "auto", "auto_graph")
            }
            auto_paths = sorted({h.path if h else "sparse" for *_, h in chunk_hints(m, cache, L, chunk, "auto")})
            del cache
            if L not in base:
                dense = DenseLayer(m).to(device=device, dtype=dtype)
                for p in dense.parameters():
                    if p.dim() >= 2:
                        nn.init.normal_(p, std=m.init_std)
                x = torch.randn(1, L, m.dim, device=device, dtype=dtype)
                with torch.no_grad():
                    dense_s = timed(lambda: dense(x), device, a.short_repeats)
                    dense_graph_s = (
                        graph_seconds(lambda: dense(x), device, a.short_repeats) if device.type == "cuda" else None
                    )
                del dense, x
                first_f = next(layer for layer in stage.layers.values() if layer.attn.indexer is not None)
                idx_s, keys_s = indexer_seconds(first_f, m, L, chunk, device, dtype, timed, op_seconds, a.short_repeats)
                base[L] = dict(dense_s=dense_s, dense_graph_s=dense_graph_s, indexer_s=idx_s, key_proj_s=keys_s)
            b = base[L]
            short_path = "dense" if L <= m.index_topk else "masked"
            share = (b["key_proj_s"] if short_path == "dense" else b["indexer_s"]) * n_f / a.short_layers
            bar = b["dense_s"] + share
            new = times["short"] / a.short_layers
            row = dict(
                index=index,
                layout="".join(layer.role for layer in stage.layers.values()),
                f_layers=n_f,
                layers=a.short_layers,
                context=L,
                chunk=chunk,
                short_path=short_path,
                auto_path="+".join(auto_paths),  # what the engine's rule runs over the chunks
                sparse_ms_per_layer=times["sparse"] / a.short_layers * 1e3,
                short_ms_per_layer=new * 1e3,
                dense_layer_ms=b["dense_s"] * 1e3,
                indexer_ms=b["indexer_s"] * 1e3,
                key_proj_ms=b["key_proj_s"] * 1e3,
                bar_ms=bar * 1e3,
                short_within_bar=new <= bar,
                short_speedup_vs_sparse=times["sparse"] / times["short"],
                auto_ms_per_layer=times["auto"] / a.short_layers * 1e3,
                auto_within_bar=times["auto"] / a.short_layers <= bar,
                auto_speedup_vs_sparse=times["sparse"] / times["auto"],
                dense_over_sparse=b["dense_s"] / (times["sparse"] / a.short_layers),
                dense_over_short=b["dense_s"] / new,
            )
            if times["auto_graph"] is not None:  # both sides captured: no launch overhead on either
                graph_bar = b["dense_graph_s"] + share
                row.update(
                    auto_graph_ms_per_layer=times["auto_graph"] / a.short_layers * 1e3,
                    dense_graph_ms=b["dense_graph_s"] * 1e3,
                    graph_bar_ms=graph_bar * 1e3,
                    auto_graph_within_bar=times["auto_graph"] / a.short_layers <= graph_bar,
                )
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if index == LAYOUTS[0]:
            sweep += chunk_sweep(a, stage, plan, device, dtype, timed)
            rates = [masked_rate(m, L, device, dtype, timed, a.short_repeats) for L in contexts if L > m.index_topk]
        del stage
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result(a, rows, sweep, rates, device, dtype, m)


def warm_up(device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a second before the first timing: an idle GPU's first milliseconds run at lower clocks
    (the first row measured up to 25 % slow without this)."""
    if device.type != "cuda":
        return
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            x @ x
        torch.cuda.synchronize(device)


@torch.no_grad()
def masked_rate(m, L: int, device, dtype, timed, repeats: int) -> dict:
    """The split pass's middle against the sparse kernel, for the queries [topk, L) of an L-token first chunk and one
    random top-k of each: masked SDPA in QUERY_BLOCK-query blocks (block j over keys [0, topk + (j + 1) * block), the
    non-absorbed heads, the top-k as a boolean mask) and sparse_mla over the same top-k (absorbed heads). Each rate
    counts the FLOPs its form does (masked: every (query, key) pair of its blocks; sparse: the top-k), and `rate` =
    masked / sparse is what MASKED_RATE holds; `crossover_keys` the max_keys that rate gives (`masked_max_keys`)."""
    H, N, R, V, C, K = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.index_topk
    block, Tq = dense_prefill.QUERY_BLOCK, L - K
    g = torch.Generator(device=device).manual_seed(0)
    visible = torch.arange(L, device=device).view(1, L) <= torch.arange(K, L, device=device).view(Tq, 1)
    scores = torch.rand(Tq, L, device=device, generator=g).masked_fill(~visible, -1.0)
    idx = scores.topk(K, dim=-1).indices.int().sort(-1).values.view(1, Tq, K)
    mask = key_mask(idx, L)[:, None]  # [1, 1, Tq, L]
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dtype)  # noqa: E731
    q, k, v = rnd(1, H, Tq, N + R), rnd(1, H, L, N + R), rnd(1, H, L, V)
    ends = [min(L, K + t0 + block) for t0 in range(0, Tq, block)]

    def masked():
        for j, end in enumerate(ends):
            t0 = j * block
            F.scaled_dot_product_attention(
                q[:, :, t0 : t0 + block], k[:, :, :end], v[:, :, :end], attn_mask=mask[:, :, t0 : t0 + block, :end]
            )

    q_abs, kv = rnd(1, Tq, H, C + R), rnd(1, L, C + R)
    masked_s = timed(masked, device, repeats)
    sparse_s = timed(lambda: sparse_mla(q_abs, kv, idx, (C + R) ** -0.5, C), device, repeats)
    pairs = sum(min(block, Tq - j * block) * end for j, end in enumerate(ends))
    masked_flops, sparse_flops = 2 * H * (N + R + V) * pairs, 2 * H * Tq * K * (2 * C + R)
    rate = (masked_flops / masked_s) / (sparse_flops / sparse_s)
    row = dict(
        context=L,
        queries=Tq,
        masked_ms=masked_s * 1e3,
        sparse_ms=sparse_s * 1e3,
        masked_tflops=masked_flops / masked_s / 1e12,
        sparse_tflops=sparse_flops / sparse_s / 1e12,
        rate=rate,
        crossover_keys=masked_max_keys(m, rate) or None,
        masked_over_sparse=sparse_s / masked_s,
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def chunk_sweep(a, stage, plan, device, dtype, timed) -> list:
    """The same prefill in smaller chunks (--short-chunks at --short-chunk-contexts): from how many queries per
    chunk the short path beats the sparse one (MIN_PREFILL_TOKENS)."""
    out = []
    for L in (int(c) for c in a.short_chunk_contexts.split(",") if c):
        for chunk in (int(c) for c in a.short_chunks.split(",") if c):
            cache = stage_cache(stage.cfg, plan, 0, 1, L + 127, chunk, device, dtype)
            t = {p: stage_prefill_seconds(stage, cache, L, chunk, p, timed, device, 1) for p in ("sparse", "short")}
            del cache
            row = dict(
                context=L,
                chunk=chunk,
                sparse_ms_per_layer=t["sparse"] / a.short_layers * 1e3,
                short_ms_per_layer=t["short"] / a.short_layers * 1e3,
                short_speedup_vs_sparse=t["sparse"] / t["short"],
            )
            out.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return out


def min_tokens(sweep: list) -> dict:
    """Per context: the smallest chunk from which the short path beats the sparse one at every larger measured
    chunk (None: not even at the largest); `suggested` = the largest over contexts (MIN_PREFILL_TOKENS)."""
    out = {}
    for L in dict.fromkeys(r["context"] for r in sweep):
        best = None
        for r in sorted((r for r in sweep if r["context"] == L), key=lambda r: -r["chunk"]):
            if r["short_speedup_vs_sparse"] <= 1.0:
                break
            best = r["chunk"]
        out[L] = best
    found = [v for v in out.values() if v is not None]
    out["suggested"] = max(found) if found and len(found) == len(out) else None
    return out


def crossover(rows: list, topk: int) -> dict:
    """Per layout: the largest context above top-k up to which the masked path beats the sparse one at every
    measured context (0: it never does); `suggested` = the smallest over layouts."""
    out = {}
    for index in dict.fromkeys(r["index"] for r in rows):
        best = 0
        for r in sorted((r for r in rows if r["index"] == index and r["context"] > topk), key=lambda r: r["context"]):
            if r["short_speedup_vs_sparse"] <= 1.0:
                break
            best = r["context"]
        out[index] = best
    out["suggested"] = min(out.values()) if out else 0
    return out


def bench_env(a, device, dtype, layers: int, repeats: int, **more) -> dict:
    """What a bench_indexcache JSON records about its run (both parts)."""
    return dict(
        device=environment(device)["device_name"],
        torch=torch.__version__,
        model=a.model,
        extra=a.extra,
        layers=layers,
        prefill_chunk=a.prefill_chunk,
        repeats=repeats,
        dtype=str(dtype),
        **more,
    )


def result(a, rows, sweep, rates, device, dtype, m) -> dict:
    env = bench_env(
        a,
        device,
        dtype,
        a.short_layers,
        a.short_repeats,
        topk=m.index_topk,
        masked_rate=dense_prefill.MASKED_RATE,
        masked_prefill_max_keys=masked_max_keys(m),
        query_block=dense_prefill.QUERY_BLOCK,
        min_prefill_tokens=dense_prefill.MIN_PREFILL_TOKENS,
    )
    suggested = min((r["rate"] for r in rates), default=None)
    return dict(
        env=env,
        rows=rows,
        crossover=crossover(rows, m.index_topk),
        masked_rates=rates,
        suggested_masked_rate=suggested,
        chunk_sweep=sweep,
        min_tokens=min_tokens(sweep),
    )


def save(res: dict, out: Path) -> None:
    write_results(out, "indexcache_short", res, markdown(res))


def markdown(res: dict) -> str:
    e, c = res["env"], res["crossover"]
    lines = [
        f"# Short-context prefill: the DSA layer vs a plain-torch dense layer ({e['device']})",
        "",
        f"`model={e['model']}` attention, `{e['extra']}`, {e['dtype']}, batch 1, top-k {e['topk']}; a "
        f"{e['layers']}-layer stage prefills L tokens in {e['prefill_chunk']}-token chunks through its serving cache "
        f"(ms per layer); the dense layer is plain torch (MLA non-absorbed heads, causal SDPA, SwiGLU), one forward. "
        f"short = the dense path (L <= top-k) or the masked one; bar = dense + F share x (indexer, or the key "
        f"projection on the dense path). "
        f"short above top-k forces the split with every column after the first top-k masked. auto: what the serving "
        f"engine's rule runs eagerly (MASKED_RATE = {e['masked_rate']}, so masked up to "
        f"{e['masked_prefill_max_keys'] or 'no'} keys; split = causal first top-k columns, then masked query blocks "
        f"up to that extent, then sparse).",
        "",
        "| layout | context | short path | auto path | sparse ms | short ms | auto ms | dense ms | indexer ms "
        "| key proj ms | bar ms | short <= bar | auto <= bar | auto / sparse speedup | dense / sparse | dense / short |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
    for r in res["rows"]:
        lines.append(
            f"| {r['layout']} | {r['context']} | {r['short_path']} | {r['auto_path']} | {r['sparse_ms_per_layer']:.3f} "
            f"| {r['short_ms_per_layer']:.3f} | {r['auto_ms_per_layer']:.3f} | {r['dense_layer_ms']:.3f} "
            f"| {r['indexer_ms']:.3f} | {r['key_proj_ms']:.3f} | {r['bar_ms']:.3f} | {yes(r['short_within_bar'])} "
            f"| {yes(r['auto_within_bar'])} | {r['auto_speedup_vs_sparse']:.2f}x | {r['dense_over_sparse']:.2f}x "
            f"| {r['dense_over_short']:.2f}x |"
        )
    graphed = [r for r in res["rows"] if "auto_graph_ms_per_layer" in r]
    if graphed:
        lines += [
            "",
            "Captured (CUDA graphs on both sides, one pass: what a serving prefill graph of that class runs):",
            "",
            "| layout | context | auto path | auto graph ms | dense graph ms | bar ms | auto graph <= bar |",
            "|---|---:|---|---:|---:|---:|---|",
        ]
        for r in graphed:
            lines.append(
                f"| {r['layout']} | {r['context']} | {r['auto_path']} | {r['auto_graph_ms_per_layer']:.3f} "
                f"| {r['dense_graph_ms']:.3f} | {r['graph_bar_ms']:.3f} | {yes(r['auto_graph_within_bar'])} |"
            )
    per = ", ".join(f"{k} {v}" for k, v in c.items() if k != "suggested")
    lines += [
        "",
        f"Layer crossover (largest context above top-k where the forced short path beats sparse at every measured "
        f"context): {per}.",
        "",
    ]
    if res["masked_rates"]:
        lines += [
            f"Masked attention against the sparse kernel, queries [top-k, L) of a first chunk ({e['query_block']}-query "
            f"blocks; FLOPs each form does):",
            "",
            "| context | queries | masked ms | masked TFLOP/s | sparse ms | sparse TFLOP/s | rate | crossover keys "
            "| masked / sparse speedup |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["masked_rates"]:
            lines.append(
                f"| {r['context']} | {r['queries']} | {r['masked_ms']:.3f} | {r['masked_tflops']:.1f} "
                f"| {r['sparse_ms']:.3f} | {r['sparse_tflops']:.1f} | {r['rate']:.3f} | {r['crossover_keys'] or '-'} "
                f"| {r['masked_over_sparse']:.2f}x |"
            )
        lines += ["", f"suggested MASKED_RATE = {res['suggested_masked_rate']:.3f} (the lowest measured).", ""]
    if res["chunk_sweep"]:
        lines += [
            f"Chunk size (all-F, ms per layer; MIN_PREFILL_TOKENS = {e['min_prefill_tokens']} now):",
            "",
            "| context | chunk | sparse ms | short ms | short / sparse speedup |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in res["chunk_sweep"]:
            lines.append(
                f"| {r['context']} | {r['chunk']} | {r['sparse_ms_per_layer']:.3f} | {r['short_ms_per_layer']:.3f} "
                f"| {r['short_speedup_vs_sparse']:.2f}x |"
            )
        mt = res["min_tokens"]
        per = ", ".join(f"{k}: {v}" for k, v in mt.items() if k != "suggested")
        lines += [
            "",
            f"Smallest winning chunk per context: {per}; suggested MIN_PREFILL_TOKENS = {mt['suggested']}.",
            "",
        ]
    return "\n".join(lines)
