"""Human-readable rendering of a Plan: a per-stage table, promotions with reasons, boundary trade-offs, graph blocks.

Layer notation in the stage table: `5:S<4` = layer 5 is S and reads layer 4's indices (with cross-stage indices
layer 4 may sit on an earlier stage); `4:F!` = declared S,
promoted to F (its reason is listed under the table); `6:F` = declared F.
"""

from __future__ import annotations

import io
from typing import Iterable, Optional

from rich import box
from rich.console import Console
from rich.table import Table

from dsaflow.plan.plan import Plan


def human(n: float, unit: str = "", base: int = 1000) -> str:
    """1234567 -> '1.23M' (base 1000) or bytes -> '1.18 MiB' (base 1024)."""
    prefixes = ["", "K", "M", "G", "T", "P", "E"]
    x, i = float(n), 0
    while abs(x) >= base and i < len(prefixes) - 1:
        x /= base
        i += 1
    suffix = prefixes[i] + ("i" if base == 1024 and i else "") + unit
    text = f"{x:.0f}" if i == 0 else f"{x:.3g}"
    return f"{text} {suffix}".rstrip() if base == 1024 or unit else f"{text}{suffix}"


def ntokens(n: int) -> str:
    """Token counts in the units people say: 131072 -> '128K', 1024 -> '1K', 1000 -> '1000'."""
    for div, unit in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def approx_tokens(n: int) -> str:
    """A large token count to 3 significant digits: 3822934 -> '3.82M', 45210 -> '45.2K', 812 -> '812'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.3g}{unit}" if v < 1000 else f"{v:.0f}{unit}"
    return str(n)


def nbytes(n: float) -> str:
    return human(n, "B", 1024)


def flops(n: float) -> str:
    return human(n, "FLOP")


def _n(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def layer_marks(plan: Plan, layer_ids: Iterable[int]) -> str:
    out = []
    for i in layer_ids:
        l = plan.layers[i]
        if l.promoted:
            out.append(f"{i}:F!")
        elif l.role == "F":
            out.append(f"{i}:F")
        else:
            out.append(f"{i}:S<{l.source}")
    return " ".join(out)


def _stage_table(plan: Plan, est, part: str = "all") -> Table:
    """part: all | layers (stage, rank, roles) | numbers (stage and its estimates): narrow terminals get two tables."""
    ctx = est.get("savings_context", 0)
    t = Table(title="stages" if part != "numbers" else "stage estimates", box=box.SIMPLE_HEAD)
    t.add_column("stage", no_wrap=True)
    if part != "numbers":
        t.add_column("rank", no_wrap=True)
        t.add_column("layers\n(F, S<source, F! promoted)", overflow="fold", min_width=16, max_width=60)
        t.add_column("F/S/!", no_wrap=True, justify="right")
    moe = any(se.get("moe_layers") for se in est["stages"])
    if part != "layers":
        for col in (
            *(("params\n(total)", "params\n(active)") if moe else ("params",)),
            f"indexer saved\n/token @{ntokens(ctx)}",
            "KV cache\n/seq",
            "activations\n/microbatch",
            "fwd\ncost",
        ):
            t.add_column(col, no_wrap=True, justify="right")
    total_cost = sum(s["forward_flops_per_token"] for s in est["stages"]) or 1
    for st, se in zip(plan.stages, est["stages"]):
        cells = [str(st.index)]
        if part != "numbers":
            cells += [str(st.rank), layer_marks(plan, st.layers), f"{se['f_layers']}/{se['s_layers']}/{se['promoted']}"]
        if part != "layers":
            cells += [
                human(se["params"]),
                *((human(se["active_params"]),) if moe else ()),
                flops(se["indexer_flops_saved_per_token"]),
                nbytes(se["kv_cache_bytes_per_seq"]),
                f"{nbytes(se['activation_bytes_per_microbatch'])} x{se['microbatches_in_flight']}",
                f"{100 * se['forward_flops_per_token'] / total_cost:.1f}%",
            ]
        t.add_row(*cells)
    return t


def _memory_table(plan: Plan, est) -> Optional[Table]:
    """Training only: each stage's estimated peak on a GPU (bf16 autocast), by term (dsaflow.plan.memory)."""
    if not any(se.get("train_memory_bytes") for se in est["stages"]):
        return None
    p = plan.pipeline
    group = f"dp {p.dp}" + (f" x cp {p.cp}" if p.cp > 1 else "")
    sharded = f"; per rank, weights and AdamW state sharded over {group}" if p.replicas > 1 and p.dp_shard else ""
    t = Table(title=f"training memory per stage (GPU, bf16 autocast; GiB{sharded})", box=box.SIMPLE_HEAD)
    for col in ("stage", "weights\n+AdamW", "grads", "activations\n(x in flight)", "backward\ntransient", "peak"):
        t.add_column(col, no_wrap=True, justify="right")
    for se in est["stages"]:
        terms = list(se["train_memory_bytes"].values())
        cells = [f"{v / 2**30:.1f}" for v in terms]
        cells[2] += f" (x{se['microbatches_in_flight']})"
        t.add_row(str(se["index"]), *cells, f"{se['train_peak_bytes'] / 2**30:.1f}")
    return t


def _serve_memory_table(est) -> Optional[Table]:
    """Serving only: what each stage holds on a GPU in serve.weights' format and the KV tokens that fit beside it on
    plan.device_memory_gib (dsaflow.plan.serve_memory)."""
    sv = est.get("serve")
    if not sv:
        return None
    gib = 2**30
    caches = "fp8" if sv.get("kv_dtype") == "fp8" else "bf16" if sv["dtype_bytes"] == 2 else "fp32"
    t = Table(
        title=f"serving memory per stage (GiB) on a {sv['device_memory_bytes'] / gib:.1f} GiB device "
        f"(plan.device_memory_gib), {sv['usable_fraction']:.0%} usable",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,  # fits an 80-column terminal with the rank column
    )
    asked = f"KV asked\n{sv['max_batch']}x{ntokens(sv['max_context'])}"
    # short headers: the table fits an 80-column terminal (a truncated header would hide what a column is)
    shared = len({se["rank"] for se in est["stages"]}) < len(est["stages"])  # a rank column only where it says more
    cols = ("stage", *(("rank",) if shared else ()), f"weights\n{sv['weights']}", f"KV B/tok\n{caches}", "work\nbufs")
    for col in (*cols, asked, "total", "KV tokens\nthat fit", "rows of\nmax_ctx"):
        t.add_column(col, no_wrap=True, justify="right")
    for se in est["stages"]:
        terms, fit = se["serve_memory_bytes"], se["serve_kv_tokens_fit"]
        t.add_row(
            str(se["index"]),
            *((str(se["rank"]),) if shared else ()),
            f"{se['serve_weight_bytes'] / gib:.1f}",
            f"{se['serve_kv_bytes_per_token']:,}",
            f"{se['serve_work_buffer_bytes'] / gib:.1f}",
            f"{terms['KV and indexer-key caches'] / gib:.1f}",
            f"{sum(terms.values()) / gib:.1f}" + ("" if se["serve_fits"] else " !"),
            approx_tokens(fit) if fit >= 0 else "none",  # plan.json has the exact count
            approx_tokens(max(fit, 0) // (sv["max_context"] + 1)),
        )
    return t


def _serve_memory_notes(est) -> str:
    sv = est["serve"]
    shared = any(len(r["stages"]) > 1 for r in sv["ranks"])
    over = [r for r in sv["ranks"] if not r["fits"]]
    weights = (
        "projections in e4m3 + one fp32 scale per 128x128 block, the router fp32, the rest in the serve dtype"
        if sv["weights"] == "fp8"
        else "every weight in the serve dtype but the fp32 router"
    )
    lines = [
        f"serve.weights={sv['weights']}: {weights} (dsaflow/config/fp8_policy.py). KV tokens that fit = "
        f"({sv['usable_fraction']:.0%} of the device - weights - work buffers) / KV bytes per "
        f"token{', per rank (its stages share one device)' if shared else ''}; asked: serve.max_batch "
        f"{sv['max_batch']} x (serve.max_context {sv['max_context']} + 1) = {sv['kv_tokens_asked']:,}. Work buffers: "
        "index caches, the last stage's logits and MoE work buffers of one prefill pass (serve.max_batch x "
        "serve.prefill_chunk tokens)."
    ]
    if over:
        lines.append(
            f"! ranks {[r['rank'] for r in over]} do not fit plan.device_memory_gib (dsaflow plan exits 2 on this)"
        )
    return "\n".join(lines)


def _boundary_table(est, part: str = "all") -> Table:
    """part: all | microbatch (training/prefill trade) | decode (per decode token): narrow terminals get two tables."""
    sent = any(b.get("carries_indices") for b in est["boundaries"])
    title = "stage boundaries: sending the top-k indices across vs recomputing them on the next stage " + (
        "(cross-stage indices on: 'sent' boundaries carry them)" if sent else "(transfer is off: this is the trade)"
    )
    t = Table(title=title if part != "decode" else "the same trade per decode token", box=box.SIMPLE_HEAD)
    t.add_column("after\nstage", no_wrap=True)
    t.add_column("next stage\nstarts with", no_wrap=True)
    t.add_column("indices", no_wrap=True)
    cols = []
    if part != "decode":
        cols += [
            ("payload\n/microbatch", "index_payload_bytes_per_microbatch", nbytes),
            ("recompute\n/microbatch", "recompute_indexer_flops_per_microbatch", flops),
        ]
    if part != "microbatch":
        cols += [
            ("payload\n/decode token", "index_payload_bytes_per_decode_token", nbytes),
            ("recompute\n/decode token", "recompute_indexer_flops_per_decode_token", flops),
        ]
    if part != "decode":
        cols += [("indexer\nparams", "recompute_indexer_params", human)]
    for head, _, _ in cols:
        t.add_column(head, no_wrap=True, justify="right")
    for b in est["boundaries"]:
        start = f"layer {b['first_layer']}: " + ("S -> promoted" if b["promoted"] else b["declared"])
        how = "sent" if b.get("carries_indices") else ("recomputed" if b["promoted"] else "-")
        t.add_row(str(b["after_stage"]), start, how, *[fmt(b[key]) for _, key, fmt in cols])
    return t


def terminal_width(default: int = 100) -> int:
    """Columns of the terminal (COLUMNS, else the tty, else `default`), clamped to 60..160."""
    import shutil

    return max(60, min(160, shutil.get_terminal_size((default, 24)).columns))


def _rank_span(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def mesh_text(plan: Plan, cfg) -> str:
    """The data-parallel mesh: world size, which global ranks form each replica and each dp group, the global
    batch, and how each stage's state is held."""
    p = plan.pipeline
    if p.cp == 1:
        head = f"mesh (dp, pp) = ({p.dp}, {p.ranks}): world size {p.world_size}; global rank = dp index x {p.ranks} + "
    else:
        head = (
            f"mesh (dp, cp, pp) = ({p.dp}, {p.cp}, {p.ranks}): world size {p.world_size}; global rank = (dp index x "
            f"{p.cp} + cp index) x {p.ranks} + "
        )
    lines = [head + "pipeline rank (each replica's pipeline on consecutive ranks)"]
    show = range(p.dp) if p.dp <= 8 else (*range(3), p.dp - 1)
    for d in show:
        if p.dp > 8 and d == p.dp - 1:
            lines.append("  ...")
        spans = ", ".join(_rank_span(p.global_rank(d, 0, c), p.ranks) for c in range(p.cp))
        lines.append(f"  replica dp={d}: ranks {spans}" + (" (one pipeline per cp rank)" if p.cp > 1 else ""))
    for r in range(min(p.ranks, 8)):
        members = [p.global_rank(d, r, c) for d in range(p.dp) for c in range(p.cp)]
        shown = ", ".join(map(str, members[:8])) + (", ..." if len(members) > 8 else "")
        stages = [s.index for s in plan.stages if s.rank == r]
        lines.append(f"  dp group of pipeline rank {r} (stages {stages}): ranks {shown}")
    if p.ranks > 8:
        lines.append("  ...")
    how = (
        "serving replicas: each holds whole stages and serves every dp-th request (round-robin, in input order)"
        if cfg.mode == "serve"
        else "each stage's weights, gradients and AdamW state sharded over its dp group (FSDP2, parallel.dp_shard=true)"
        if p.dp_shard
        else "each replica holds whole stages; gradients all-reduced over the dp group once per step "
        "(parallel.dp_shard=false)"
    )
    lines.append(f"  {how}")
    if cfg.mode == "train":
        t = cfg.train
        per_mb = t.batch_size // (p.dp * p.microbatches)
        lines.append(
            f"  global batch {t.batch_size} sequences = dp {p.dp} x {p.microbatches} microbatches x {per_mb} "
            f"sequences of {t.seq_len} tokens"
        )
    return "\n".join(lines)


def cp_text(plan: Plan, est) -> str:
    """parallel.cp: the sequence split, and the keys each rank receives per microbatch (dsaflow.plan.estimates)."""
    p = plan.pipeline
    per_stage = [sum(se["cp_comm_bytes_per_layer"]) for se in est["stages"]]
    worst = max(range(len(per_stage)), key=per_stage.__getitem__)
    return (
        f"context parallel: cp {p.cp} ranks per sequence (2 x {p.cp} zigzag chunks, rank r holds r and "
        f"{2 * p.cp - 1}-r), {est['microbatch_tokens']:,} tokens per rank and microbatch; {p.world_size} ranks = pp "
        f"{p.ranks} x dp {p.dp} x cp {p.cp}. Keys gathered per layer (latent rows, indexer keys on F layers), received "
        f"per rank and microbatch in gather + backward gather + reduce-scatter: up to "
        f"{nbytes(per_stage[worst])} for stage {worst}'s {len(est['stages'][worst]['cp_comm_bytes_per_layer'])} "
        "layers."
    )


def _mtp_line(m, se) -> str:
    """Where the MTP layers live and what they hold, the explicit embedding copy named."""
    copy = m.mtp_layers * m.vocab_size * m.dim
    return (
        f"multi-token prediction: {_n(se['mtp_layers'], 'MTP layer')} on stage {se['index']} (the last), "
        f"{human(se['mtp_params'])} params counted there, of which {human(copy)} are its own copy of the token "
        f"embedding ({m.vocab_size} x {m.dim}, `mtp.<i>.embed`)"
    )


def render_table(plan: Plan, cfg, width: Optional[int] = None) -> str:
    """The `dsaflow plan` text: header, stage table, promotions, boundary trade-offs, graph blocks, totals.
    width: columns to fit (default: the terminal's, 60..160); long cells and headers wrap to fit."""
    est = plan.estimates
    buf = io.StringIO()
    con = Console(file=buf, width=width or terminal_width(), force_terminal=False, color_system=None, soft_wrap=False)
    p, m = plan.pipeline, cfg.model
    con.print(
        f"model={m.name}: {plan.num_layers} layers, dim {m.dim}, {m.n_heads} heads, indexer {m.index_n_heads}x"
        f"{m.index_head_dim}, topk {m.index_topk} | {_n(plan.num_stages, 'stage')} on {_n(p.ranks, 'rank')} "
        f"({p.stages_per_rank} per rank), schedule {p.schedule}, {p.microbatches} microbatches"
        + (f" | x dp {p.dp} = {p.world_size // p.cp} ranks" if p.dp > 1 else "")
        + (f" | x cp {p.cp} = {p.world_size} ranks" if p.cp > 1 else "")
        + f" | mode={cfg.mode}"
    )
    if p.dp > 1:
        con.print(mesh_text(plan, cfg))
    if p.cp > 1:
        con.print(cp_text(plan, est))
    if con.width >= 140:
        con.print(_stage_table(plan, est))
    else:  # narrow terminal: roles and estimates side by side would not fit
        con.print(_stage_table(plan, est, "layers"))
        con.print(_stage_table(plan, est, "numbers"))
    for memory in (_memory_table(plan, est), _serve_memory_table(est)):
        if memory is not None:
            con.print(memory)
    if est.get("serve"):
        con.print(_serve_memory_notes(est))
    promoted = [l for l in plan.layers if l.promoted]
    if promoted:
        con.print("promoted layers (declared S, run as F):")
        for l in promoted:
            con.print(f"  layer {l.index} (stage {l.stage}): {l.reason}")
    else:
        con.print("promoted layers: none")
    if est["boundaries"]:
        if con.width >= 120:
            con.print(_boundary_table(est))
        else:
            con.print(_boundary_table(est, "microbatch"))
            con.print(_boundary_table(est, "decode"))
    mtp = next((se for se in est["stages"] if se.get("mtp_layers")), None)
    if mtp is not None:
        con.print(_mtp_line(m, mtp))
    if plan.graph_blocks:
        con.print("graph blocks:")
        for b in plan.graph_blocks:
            span = f" layers {b.layers[0]}..{b.layers[-1]}" if b.layers else ""
            con.print(f"  {b.name} ({b.kind}{span}) on stages {list(b.stages)}, shape classes {list(b.shape_classes)}")
    else:
        con.print("graph blocks: none")
    tot = est["total"]
    saved, full = tot["indexer_flops_saved_per_token"], tot["indexer_flops_all_full_per_token"]
    active = f" ({human(tot['active_params'])} active per token)" if tot["active_params"] != tot["params"] else ""
    con.print(
        f"total: {human(tot['params'])} params{active}, {tot['f_layers']} F / {tot['s_layers']} S layers "
        f"({tot['promoted']} promoted)\n"
        f"indexer per token at {ntokens(est['savings_context'])} context: {flops(full - saved)} instead of "
        f"{flops(full)} with every layer F ({100 * saved / full if full else 0:.1f}% saved; sparse attention "
        f"{flops(tot['sparse_attn_flops_per_token'])})\n"
        f"KV cache: {nbytes(tot['kv_cache_bytes_per_seq'])} per {ntokens(est['kv_context'])}-token sequence; "
        f"activations per microbatch of {est['microbatch_tokens']} tokens; stage cost balance max/mean {est['balance']:.2f}"
    )
    aligned = est.get("f_aligned_split")
    if aligned:
        con.print(
            f"F-aligned split (index.promote=false): every stage starts on F, stage cost balance max/mean "
            f"{aligned['balance']:.2f} against {aligned['balance_anywhere']:.2f} with boundaries anywhere "
            f"(stages starting at {aligned['starts_anywhere']}, which needs pipeline.cross_stage_indices=true)"
        )
    if plan.index_boundaries:
        carried = [b for b in est["boundaries"] if b.get("carries_indices")]
        con.print(
            f"cross-stage indices: after stages {list(plan.index_boundaries)}, "
            f"{nbytes(sum(b['index_payload_bytes_per_microbatch'] for b in carried))} per microbatch in all, instead "
            f"of {flops(sum(b['recompute_indexer_flops_per_microbatch'] for b in carried))} of indexer work"
        )
    con.print(f"assumptions: {est['assumptions']}")
    return buf.getvalue()
