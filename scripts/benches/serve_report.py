"""What `bench_serve.py engine` reports from its rows: the comparisons it exists for, the markdown table, the
figure, and the one-line host summary of a row."""

from __future__ import annotations

from dsaflow.pipeline.ticks import HOST_PHASES


def host_line(row: dict) -> str:
    """Per rank: host ms per decode tick (by phase), the median lead of a decode pass on its GPU, the share of decode
    passes the GPU waited for (the host was late)."""

    def per_rank(values, digits):
        return [None if v is None else round(v, digits) for v in values]

    hosts = row["decode_host_ms_per_tick"]
    phases = ", ".join(f"{k} {per_rank([h[k] for h in hosts], 3)}" for k in HOST_PHASES)
    return (
        f"host ms per decode tick {per_rank([sum(h.values()) for h in hosts], 3)} ({phases}), lead p50 ms "
        f"{per_rank(row['decode_lead_p50_ms'], 3)}, host late {per_rank(row['decode_host_late'], 2)}"
    )


TICK_COLOURS = {"decode": "C0", "prefill": "C1", "mixed": "C2"}  # the figure's tick timeline, by tick kind
MAX_SEGMENTS = 2000  # a row keeps at most this many tick segments (its JSON stays small)


def coarse_segments(segments: list, bins: int = MAX_SEGMENTS) -> list:
    """A run's [(start s, end s, kind)] tick segments (Timeline._kind_summary) -> at most `bins` segments: kept as
    they are when few enough, else the run cut into `bins` equal spans, each labelled with the kind that took most of
    it (merged with its neighbour when of the same kind). For drawing, not for accounting: busy fractions and tick
    counts come from the timeline itself."""
    if len(segments) <= bins:
        return [list(s) for s in segments]
    end = segments[-1][1]
    width = end / bins
    out: list = []
    i = 0
    for b in range(bins):
        lo, hi = b * width, (b + 1) * width
        share: dict = {}
        while i < len(segments) and segments[i][1] <= lo:
            i += 1
        j = i
        while j < len(segments) and segments[j][0] < hi:
            a, e, kind = segments[j]
            share[kind] = share.get(kind, 0.0) + min(e, hi) - max(a, lo)
            j += 1
        kind = max(share, key=share.get) if share else (out[-1][2] if out else "decode")
        if out and out[-1][2] == kind:
            out[-1][1] = hi
        else:
            out.append([lo, hi, kind])
    return out


def checks(rows: list) -> list:
    """The comparisons the benchmark exists for: default groups vs one group (tokens/s, decode busy) per pipeline
    and workload, continuous vs fixed batches on the mixed workload, ppNxR replicas vs ppN alone, and mixed passes
    (each budget) against both batchings: tokens/s, and TTFT p99 against today's continuous batching."""
    out = []
    key = lambda r: (r["pipeline"], r["workload"], r["microbatches_setting"], r["batching"])  # noqa: E731
    by = {key(r): r for r in rows if r.get("max_pass_tokens") is None}
    for r in rows:
        budget, p, w = r.get("max_pass_tokens"), r["pipeline"], r["workload"]
        graphs = r.get("mixed_graphs")
        eager = next(
            (e for e in rows if (e["pipeline"], e["workload"], e.get("max_pass_tokens")) == (p, w, budget)
             and e.get("mixed_graphs") == "off"),
            None,
        )  # fmt: skip
        if budget is not None and graphs == "on" and eager is not None:
            out.append(
                {
                    "check": f"{p} {w}: mixed passes (budget {budget}) from graphs vs eager",
                    "pipeline": p,
                    "workload": w,
                    "max_pass_tokens": budget,
                    "mixed_graphs": "on vs off",
                    "tokens_per_s_ratio": r["tokens_per_s"] / eager["tokens_per_s"],
                    "ttft_p99_ratio": r["ttft_p99_s"] / eager["ttft_p99_s"]
                    if r["ttft_p99_s"] and eager["ttft_p99_s"]
                    else None,
                    "busy_fraction": r["busy_fraction"],
                }
            )
        today = by.get((p, w, "default", "continuous"))
        if budget is None or today is None:
            continue
        fixed = by.get((p, w, "default", "fixed"))
        out.append(
            {
                "check": f"{p} {w}: mixed passes (budget {budget}"
                + (f", mixed graphs {graphs}" if graphs == "on" else "")
                + ") vs today's continuous"
                + (" and fixed" if fixed else ""),
                "pipeline": p,
                "workload": w,
                "max_pass_tokens": budget,
                "mixed_graphs": graphs,
                "tokens_per_s_ratio": r["tokens_per_s"] / today["tokens_per_s"],
                "tokens_per_s_vs_fixed": r["tokens_per_s"] / fixed["tokens_per_s"] if fixed else None,
                "ttft_p99_ratio": r["ttft_p99_s"] / today["ttft_p99_s"]
                if r["ttft_p99_s"] and today["ttft_p99_s"]
                else None,
                "busy_fraction": r["busy_fraction"],
            }
        )
    for (p, w, mb, b), r in by.items():
        one = by.get((p, w, 1, "continuous"))
        if mb == "default" and b == "continuous" and one is not None and r["ranks"] > 1:
            out.append(
                {
                    "check": f"{p} {w}: default groups vs serve.microbatches=1",
                    "pipeline": p,
                    "workload": w,
                    "tokens_per_s_ratio": r["tokens_per_s"] / one["tokens_per_s"],
                    "decode_busy_default": r["decode_busy_fraction"],
                    "decode_busy_one": one["decode_busy_fraction"],
                }
            )
        alone = by.get((p.partition("x")[0], w, mb, b)) if r.get("replicas", 1) > 1 else None
        if alone is not None:  # ppNxR against ppN: how close R replicas come to R x the tokens/s
            out.append(
                {
                    "check": f"{p} {w} {b} serve.microbatches={mb}: {r['replicas']} replicas vs one",
                    "pipeline": p,
                    "workload": w,
                    "tokens_per_s_ratio": r["tokens_per_s"] / alone["tokens_per_s"],
                    "replica_tokens_per_s": r["replica_tokens_per_s"],
                }
            )
        fixed = by.get((p, w, "default", "fixed"))
        if mb == "default" and b == "continuous" and fixed is not None:
            out.append(
                {
                    "check": f"{p} {w}: continuous vs fixed batches",
                    "pipeline": p,
                    "workload": w,
                    "tokens_per_s_ratio": r["tokens_per_s"] / fixed["tokens_per_s"],
                }
            )
    return out


def per_replica(row: dict) -> str:
    """' (a + b per replica)' for a row of serving replicas, else ''."""
    if row.get("replicas", 1) == 1:
        return ""
    return f" ({' + '.join(f'{x:.1f}' for x in row['replica_tokens_per_s'])} per replica)"


def markdown(rows: list, env: dict, cks: list) -> str:
    f = lambda v, s="{:.3f}": "-" if v is None else s.format(v)  # noqa: E731
    lines = [
        "# Serving benchmark",
        "",
        "Host ms per decode tick: what each rank's host spends building, launching and passing on one tick of decode; "
        "host late (GPU only): the share of decode passes its GPU started within 50 us of their launch (it had run dry and waited on its host).",
        "",
        f"{env['device_name']}, torch {env['torch']}, model {env['model']} {env['overrides']}, "
        f"graphs {env['graphs']}, "
        f"serve.max_batch {env['max_batch']}, {env['requests']} requests per workload (mixed: prompts "
        f"{env['mixed_prompt']} log-uniform, new {env['mixed_new']}; uniform: {env['uniform_prompt']} + "
        f"{env['uniform_new']}), "
        + (
            f"arriving at {env['arrival_rate']:g} per second (Poisson; TTFT from each arrival), "
            if env.get("arrival_rate")
            else "all there at the start (TTFT includes the wait for a cache row), "
        )
        + f"{env['threads']} thread(s) per process on CPU, 1-minute load average {env['load_average_1min'][0]:.1f} "
        f"before and {env['load_average_1min'][1]:.1f} after. Command: `{env['command']}`.",
        "",
        "Budget: serve.max_pass_tokens (mixed passes; - = a pass prefills or decodes); mixed: the share of passes "
        "that carried decoding rows and prompt chunks together; mixed graphs: on = mixed passes replayed from graphs "
        "of padded token-count classes (graphs=decode_mixed), off = eager; mixed busy: each rank's busy fraction in "
        "the ticks with a mixed pass in flight.",
        "",
        "| pipeline | groups (serve.microbatches) | workload | batching | budget | mixed graphs | mixed | tokens/s "
        "| TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms | busy per rank | decode busy per rank | mixed busy "
        "per rank | host ms per decode tick | host late |",
        "|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for r in rows:
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        lines.append(
            f"| {r['pipeline']} | {r['microbatches']} ({r['microbatches_setting']}) | {r['workload']} | "
            f"{r['batching']} | {r.get('max_pass_tokens') or '-'} | {r.get('mixed_graphs') or '-'} | "
            f"{f(r.get('mixed_pass_share'), '{:.2f}')} | "
            f"{r['tokens_per_s']:.1f}{per_replica(r)} | {f(r['ttft_p50_s'])} | {f(r['ttft_p99_s'])} | "
            f"{f(ms(r['tpot_p50_s']), '{:.2f}')} | {f(ms(r['tpot_p99_s']), '{:.2f}')} | "
            f"{', '.join(f'{b:.2f}' for b in r['busy_fraction'])} | "
            f"{', '.join(f'{b:.2f}' for b in r['decode_busy_fraction'])} | "
            f"{', '.join(f'{b:.2f}' for b in r.get('mixed_busy_fraction', [])) or '-'} | "
            f"{', '.join(f(sum(h.values()), '{:.2f}') for h in r.get('decode_host_ms_per_tick', []))} | "
            f"{', '.join(f(x, '{:.2f}') for x in r.get('decode_host_late', [])) or '-'} |"
        )
    if cks:
        lines += [
            "",
            "| comparison | tokens/s ratio | vs fixed | TTFT p99 ratio | busy per rank | decode busy (default "
            "groups) | decode busy (one group) |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        for c in cks:
            d = ", ".join(f"{b:.2f}" for b in c.get("decode_busy_default", [])) or "-"
            o = ", ".join(f"{b:.2f}" for b in c.get("decode_busy_one", [])) or "-"
            busy = ", ".join(f"{b:.2f}" for b in c.get("busy_fraction", [])) or "-"
            lines.append(
                f"| {c['check']} | {c['tokens_per_s_ratio']:.2f}x | {f(c.get('tokens_per_s_vs_fixed'), '{:.2f}x')} | "
                f"{f(c.get('ttft_p99_ratio'), '{:.2f}x')} | {busy} | {d} | {o} |"
            )
    if env.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(env["skipped"])]
    return "\n".join(lines)


def plot(rows: list, plt):
    """Tokens/s per row (mixed-pass rows hatched), each rank's whole-run and decode busy fractions, and each row's
    ticks over its run coloured by kind (decode / prefill / mixed) -> the figure."""
    fig, (ax1, ax3, ax2, ax4) = plt.subplots(1, 4, figsize=(23, 4.2))
    labels = [
        f"{r['pipeline']}\n{r['workload']}\ng={r['microbatches']} {r['batching'][:4]}"
        + (f"\nmixed {r['max_pass_tokens']}" if r.get("max_pass_tokens") else "")
        + (" graphs" if r.get("mixed_graphs") == "on" else "")
        for r in rows
    ]
    x = range(len(rows))
    colors = ["C0" if r["batching"] == "continuous" else "C7" for r in rows]
    bars = ax1.bar(x, [r["tokens_per_s"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        bar.set_hatch("//" if r.get("max_pass_tokens") else "")
    ax1.set_xticks(list(x), labels, fontsize=6)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    per_rank_bars(ax2, rows, labels, "decode_busy_fraction", "busy fraction in decode")
    ax2.legend(fontsize=7)
    ax2.set_title("per-rank busy fraction (decode ticks)")
    per_rank_bars(ax3, rows, labels, "busy_fraction", "busy fraction, whole run")
    ax3.set_title("per-rank busy fraction (every tick: prefill, mixed, decode)")
    tick_timeline(ax4, rows, labels)
    fig.tight_layout()
    return fig


def per_rank_bars(ax, rows: list, labels: list, key: str, ylabel: str) -> None:
    """One bar per rank per row of the fraction rows[i][key][rank], grouped by row, on a 0-1 axis."""
    ranks = max(r["ranks"] for r in rows)
    width = 0.8 / ranks
    x = range(len(rows))
    for k in range(ranks):
        ax.bar([i + k * width for i in x], [r[key][k] if k < r["ranks"] else 0 for r in rows], width, label=f"rank {k}")
    ax.set_xticks([i + 0.4 - width / 2 for i in x], labels, fontsize=6)
    ax.set_ylim(0, 1)
    ax.set_ylabel(ylabel)


def tick_timeline(ax, rows: list, labels: list) -> None:
    """One band per row: its run from start to end (as a fraction of its wall time), each stretch of ticks coloured
    by its kind (`TICK_COLOURS`), so a mixed tick reads apart from a decode or a prefill one."""
    for i, r in enumerate(rows):
        segments = r.get("tick_segments") or []
        end = segments[-1][1] if segments else 0
        for kind, colour in TICK_COLOURS.items():
            spans = [(a / end, (e - a) / end) for a, e, k in segments if k == kind and end > 0]
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), color=colour, label=kind)
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend([handles[k] for k in TICK_COLOURS if k in handles], [k for k in TICK_COLOURS if k in handles],
              fontsize=7, loc="upper right")  # fmt: skip
    ax.set_yticks(list(range(len(rows))), [label.replace("\n", " ") for label in labels], fontsize=5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of the run (wall time)")
    ax.set_title("ticks by kind (decode, prefill, mixed)")
