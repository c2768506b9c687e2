"""The end of a multirun: one row per job (the overrides that vary, final metrics, exit status), written into the
sweep dir as summary.csv and summary.md and returned as text for the terminal."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Dict, List, Optional

from dsaflow.files import UnsafeFile, atomic_write, read_text

METRICS = ("loss", "indexer_loss", "eval_loss", "eval_acc", "tokens_per_s")


def final_metrics(run_dir) -> Dict[str, float]:
    """Last value of each metric in <run_dir>/metrics.jsonl (eval metrics: the last eval); tokens/s: the median
    over the run's steps after the first (the first step includes start-up)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = read_text(path, inside=run_dir, max_bytes=1 << 30)
    except UnsafeFile:  # none, or not a file dsaflow wrote: no metrics to summarise
        return {}
    recs = []
    for line in text.splitlines():
        try:
            rec = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            rec = None  # a torn or corrupted line: the summary shows the records that parse
        if isinstance(rec, dict):
            recs.append(rec)
    out: Dict[str, float] = {}
    for r in recs:
        for k in ("loss", "indexer_loss", "eval_loss", "eval_acc", "eval_bpb", "step"):
            if k in r:
                out[k] = r[k]
    tps = sorted(r["tokens_per_s"] for r in recs[1:] if "tokens_per_s" in r) or [
        r["tokens_per_s"] for r in recs if "tokens_per_s" in r
    ]
    if tps:
        out["tokens_per_s"] = tps[len(tps) // 2]
    return out


def varying(results) -> List[str]:
    """Override keys whose value is not the same in every job (in first-seen order)."""
    per_job = [dict(o.split("=", 1) if "=" in o else (o, "") for o in r.overrides) for r in results]
    keys: List[str] = []
    for d in per_job:
        keys += [k for k in d if k not in keys]
    return [k for k in keys if len({d.get(k) for d in per_job}) > 1 or any(k not in d for d in per_job)] or keys


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def summary_rows(results) -> List[Dict[str, str]]:
    keys = varying(results)
    rows = []
    for r in sorted(results, key=lambda r: r.num):
        ov = dict(o.split("=", 1) if "=" in o else (o, "") for o in r.overrides)
        m = final_metrics(r.run_dir) if r.run_dir else {}
        row = {"job": str(r.num), **{k: ov.get(k, "") for k in keys}}
        row.update({k: _fmt(m.get(k)) for k in METRICS})
        row["steps"] = _fmt(m.get("step"))
        row["status"] = r.status
        row["run_dir"] = r.run_dir or ""
        rows.append(row)
    blank = [k for k in (*METRICS, "steps") if not any(row[k] for row in rows)]  # e.g. generate jobs: no loss
    return [{k: v for k, v in row.items() if k not in blank} for row in rows]


def write_summary(sweep_dir, results, wandb_group: Optional[str] = None) -> str:
    """Write summary.csv and summary.md into the sweep dir; -> the markdown table with a header line.
    `wandb_group`: the group the jobs logged to (None when no job tracked with wandb)."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(results)
    if not rows:
        return f"sweep {sweep_dir}: no job ran"
    cols = list(rows[0].keys())
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write(sweep_dir / "summary.csv", buf.getvalue())
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rows]
    ok = sum(r.exit_code == 0 for r in results)
    head = f"sweep {sweep_dir}: {ok}/{len(results)} jobs ok" + (f" (wandb group {wandb_group})" if wandb_group else "")
    text = head + "\n\n" + "\n".join(md) + "\n"
    atomic_write(sweep_dir / "summary.md", text)
    return text + f"\nwrote {sweep_dir / 'summary.csv'} and {sweep_dir / 'summary.md'}"
