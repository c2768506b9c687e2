"""The collect step of scripts/quality_table.py: results JSON of one or more runs -> docs/quality.json and the table
in docs/quality.md (one row per task and pattern, mean and sd over seeds, paired deltas against all-F)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROWS_BASE = ("all-F", "uniform 1/2", "searched 1/2", "uniform 1/4", "searched 1/4")
ROW_EVERY4 = "every4 trained"
ROW_CONTINUED = "every4 continued"  # --continued-steps: all-F trained on with index=every4 (train.init_from)
ORDER = ROWS_BASE + (ROW_EVERY4, ROW_CONTINUED)


def _mean_sd(xs):
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)  # no spread from one seed


def collect_rows(dirs) -> list:
    """One row per (task, pattern) over every results JSON under the given dirs, with paired deltas against all-F of
    the same task and seed."""
    per = {}
    for d in dirs:
        for p in sorted((Path(d) / "results").glob("*.json")):
            r = json.loads(p.read_text())
            key = (r["task"], r["pattern"], r["seed"])
            if key in per:
                print(f"collect: {p} repeats {key}; keeping the first", file=sys.stderr)
                continue
            per[key] = r
    base = {(t, s): r for (t, pat, s), r in per.items() if pat == "all-F"}
    rows = []
    tasks = sorted({t for t, _, _ in per}, key=lambda t: (t != "retrieval_long", t))
    for task in tasks:
        pats = {p for t, p, _ in per if t == task}
        for pat in [p for p in ORDER if p in pats] + sorted(pats - set(ORDER)):
            runs = sorted((r for (t, p, _), r in per.items() if t == task and p == pat), key=lambda r: r["seed"])
            row = {"pattern": pat, "task": task, "seeds": [r["seed"] for r in runs]}
            for m in ("acc", "loss") + (("bpb",) if task == "text" else ()):
                row[f"{m}_mean"], row[f"{m}_sd"] = _mean_sd([r.get(m) for r in runs])
            for m, scale, name in (("loss", 1, "d_loss"), ("acc", 100, "d_acc_points"), ("bpb", 1, "d_bpb")):
                if m == "bpb" and task != "text":
                    continue
                ds = []
                for r in runs:
                    b = base.get((task, r["seed"]))
                    ok = b is not None and r.get(m) is not None and b.get(m) is not None
                    ds.append(scale * (r[m] - b[m]) if ok else None)
                row[f"{name}_mean"], row[f"{name}_sd"] = _mean_sd(ds)
            row["layouts"] = [r["roles"] for r in runs]
            row["per_seed"] = [
                {k: r.get(k) for k in ("seed", "roles", "loss", "acc", "bpb", "train", "overrides") if k in r}
                for r in runs
            ]
            rows.append(row)
    return rows


def _f(x, fmt, signed=False):
    """x in `fmt`; a loss too small for 4 decimals (a task the model has learned) in 2 significant digits."""
    if x is None:
        return "n/a"
    sign = "+" if signed else ""
    if fmt == ".4f" and x != 0 and abs(x) < 5e-5:
        return format(x, sign + ".1e")
    return format(x, sign + fmt)


def markdown(rows) -> str:
    md = []
    for task in dict.fromkeys(r["task"] for r in rows):
        text = task == "text"
        m, dm, fm = ("bpb", "d_bpb", ".4f") if text else ("acc", "d_acc_points", ".3f")
        head = "bits per byte" if text else "accuracy"
        dhead = "Δ bits per byte" if text else "Δ accuracy (points)"
        md += [
            f"**{task}**",
            "",
            f"| pattern | seeds | eval loss | {head} | Δ loss vs all-F | {dhead} vs all-F | layouts |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["task"] == task):
            lays = sorted(set(r["layouts"]))
            md.append(
                f"| {r['pattern']} | {len(r['seeds'])} | {_f(r['loss_mean'], '.4f')} ± {_f(r['loss_sd'], '.4f')} | "
                f"{_f(r[m + '_mean'], fm)} ± {_f(r[m + '_sd'], fm)} | "
                f"{_f(r['d_loss_mean'], '.4f', True)} ± {_f(r['d_loss_sd'], '.4f')} | "
                f"{_f(r[dm + '_mean'], '.1f' if not text else '.4f', True)} ± "
                f"{_f(r[dm + '_sd'], '.1f' if not text else '.4f')} | {' / '.join(f'`{x}`' for x in lays)} |"
            )
        md.append("")
    return "\n".join(md)


BEGIN, END = "<!-- quality-table:begin -->", "<!-- quality-table:end -->"


def cmd_collect(a) -> int:
    rows = collect_rows(a.dirs)
    if not rows:
        print(f"collect: no results JSON under {[str(Path(d) / 'results') for d in a.dirs]}", file=sys.stderr)
        return 1
    few = sorted({(r["task"], r["pattern"]) for r in rows if len(r["seeds"]) < 3})
    if few:
        print(f"collect: fewer than 3 seeds for {few}", file=sys.stderr)
    recipes = {r["task"]: r["per_seed"][0].get("overrides") for r in rows if r["pattern"] == "all-F"}
    Path(a.json).write_text(json.dumps({"rows": rows, "all_f_overrides": recipes}, indent=1) + "\n")
    table = markdown(rows)
    md = Path(a.md)
    doc = md.read_text() if md.is_file() else ""
    if BEGIN in doc and END in doc:
        md.write_text(doc[: doc.index(BEGIN) + len(BEGIN)] + "\n" + table + doc[doc.index(END) :])
        print(f"collect: wrote {a.json} and the table of {md}")
    else:
        print(f"collect: wrote {a.json}; {md} has no {BEGIN} ... {END} section, so the table is only printed")
    print(table)
    return 0
