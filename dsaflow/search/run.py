"""`dsaflow search search.checkpoint=RUN_DIR [search.ratio=0.25 | search.target_f=N] [pipeline=...]`.

Loads an all-F training checkpoint into every stage of the model in this one process, runs the greedy search on
calibration batches (training-split batches the run never trained on), and writes into `search.out_dir`
(default `<RUN_DIR>/search`):

    search.jsonl    the resumable log (every candidate and every step)
    search.csv      one row per step: removed layer, F count, calibration loss / accuracy, layout
    search.png      calibration loss per step, with values (needs matplotlib: pip install 'dsaflow[plots]')
    eval.json, eval.md   eval loss / accuracy of all-F, uniform and searched patterns at the same F counts
and prints the `layout=` string to paste into `dsaflow train` / `dsaflow generate`.

The model, data and sequence length come from the checkpoint's run dir; the stage split comes from this command's
`pipeline.*`. Each stage's first layer stays F, so the searched layout runs on that split without promotion (and
with index.promote=false). With `pipeline.cross_stage_indices=true` only layer 0 stays F: a stage may open on S
layers that read the previous stage's indices, and the layout is then run with cross-stage indices on.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from typing import List, Tuple

import torch

from dsaflow.errors import PlanError, ServeError
from dsaflow.files import atomic_write
from dsaflow.outputs import check_output_dir
from dsaflow.plan.layout import format_layout, freq_roles

from .evaluate import PatternEvaluator
from .greedy import SearchLog, Step, greedy_search
from .png import write_search_png

CALIB_STEP_OFFSET = 1_000_000  # calibration batch i = training batch CALIB_STEP_OFFSET + i (never trained on)


def stage_starts_of(plan) -> Tuple[int, ...]:
    return tuple(s.layers[0] for s in plan.stages)


def kept_f(plan, cross_stage: bool) -> Tuple[int, ...]:
    """The layers the search never turns to S: each stage's first layer, or only layer 0 with cross-stage indices."""
    return (0,) if cross_stage else stage_starts_of(plan)


def uniform_roles(freq: int, num_layers: int, starts) -> Tuple[str, ...]:
    """Every `freq`-th layer F (index.freq), plus the layers in `starts` (each stage's first layer, what the planner
    would promote; only layer 0 with cross-stage indices)."""
    roles = list(freq_roles(freq, 0, num_layers))
    for s in starts:
        roles[s] = "F"
    return tuple(roles)


def load_search_model(cfg, device: torch.device):
    """-> (train cfg of the checkpoint run, plan (all F, this command's stages), [StageModule]) with weights loaded."""
    import copy

    from dsaflow.checkpoint.weights import load_model_weights, resolve_checkpoint
    from dsaflow.config.compose import load_config
    from dsaflow.pipeline.stages import build_stages
    from dsaflow.plan import build_plan
    from dsaflow.rundir.folder import CONFIG, PLAN

    s = cfg.search
    if not s.checkpoint:
        raise PlanError(
            "dsaflow search needs search.checkpoint=<a run dir trained with index=all_full>. Fix: e.g. "
            "search.checkpoint=runs/20260101-120000-tiny-retrieval."
        )

    try:
        ckpt = resolve_checkpoint(s.checkpoint)
    except ServeError as exc:
        raise PlanError(str(exc).replace("serve.checkpoint", "search.checkpoint")) from None
    run_dir = ckpt.parent.parent
    if not (run_dir / CONFIG).is_file():
        raise PlanError(
            f"search.checkpoint={s.checkpoint}: {run_dir / CONFIG} is missing, so the model it was trained "
            "with is unknown. Fix: point search.checkpoint at a run dir written by `dsaflow train`."
        )
    trained = load_config(run_dir / CONFIG)
    if (run_dir / PLAN).is_file():
        from dsaflow.plan.plan import Plan

        old = Plan.from_json((run_dir / PLAN).read_text())
        s_layers = [l.index for l in old.layers if l.role == "S"]
        if s_layers:
            raise PlanError(
                f"search.checkpoint={s.checkpoint} was trained with S layers {s_layers}, which have no indexer "
                "weights, so the search cannot try them as F. Fix: search from a run trained with index=all_full."
            )
    run_cfg = copy.deepcopy(trained)
    run_cfg.index.pattern, run_cfg.index.freq, run_cfg.index.offset, run_cfg.layout = None, None, 0, None
    run_cfg.pipeline = cfg.pipeline
    run_cfg.graphs.enabled, run_cfg.graphs.blocks = False, []
    run_cfg.mode = "serve"  # no training schedule runs: the microbatch rules do not apply
    plan = build_plan(run_cfg)
    stages = build_stages(run_cfg.model, plan, seed=0)
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load_model_weights({i: m for i, m in enumerate(stages)}, ckpt, run_cfg.model)
    for m in stages:
        m.to(device).eval()
    return run_cfg, plan, stages, ckpt


def _batches(run_cfg, n: int, calib: bool):
    from dsaflow.data import BatchSource

    t = run_cfg.train
    data = BatchSource(run_cfg.data, t.seq_len, t.batch_size, t.seed, run_cfg.model.vocab_size)
    nq = run_cfg.data.num_queries if data.has_answers else 0
    if calib:
        return [data.batch(CALIB_STEP_OFFSET + i) for i in range(n)], nq
    return [data.val_batch(i) for i in range(n)], nq


def eval_table(evaluator: PatternEvaluator, steps: List[Step], starts, ratios, fixed=None) -> List[dict]:
    """all-F, and per ratio: uniform (every round(1/ratio)-th layer + stage firsts) and the searched pattern with the
    same F count (when the search went that far). Scored on `evaluator`'s batches (the held-out eval set)."""
    L = evaluator.num_layers
    by_f = {s.num_f: s.roles for s in steps}
    rows = []
    full = evaluator.score(tuple("F" * L))
    rows.append({"pattern": "all-F", "ratio": 1.0, "num_f": L, "roles": "F" * L, "loss": full.loss, "acc": full.acc})
    for r in ratios:
        freq = max(1, round(1 / r))
        uni = uniform_roles(freq, L, starts if fixed is None else fixed)
        nf = uni.count("F")
        sc = evaluator.score(uni)
        rows.append(
            {
                "pattern": f"uniform 1/{freq}",
                "ratio": r,
                "num_f": nf,
                "roles": "".join(uni),
                "loss": sc.loss,
                "acc": sc.acc,
            }
        )
        if nf in by_f:
            sc = evaluator.score(tuple(by_f[nf]))
            rows.append(
                {
                    "pattern": f"searched 1/{freq}",
                    "ratio": r,
                    "num_f": nf,
                    "roles": by_f[nf],
                    "loss": sc.loss,
                    "acc": sc.acc,
                }
            )
    return rows


def _md_table(rows: List[dict], starts) -> str:
    bpb = bool(rows) and "bpb" in rows[0]
    out = [
        "| pattern | F layers | layout | eval loss | " + ("bits per byte" if bpb else "eval acc") + " |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        last = f"{r['bpb']:.4f}" if bpb else ("n/a" if r["acc"] != r["acc"] else f"{r['acc']:.3f}")
        out.append(
            f"| {r['pattern']} | {r['num_f']} | `{format_layout(tuple(r['roles']), starts)}` | {r['loss']:.4f} | {last} |"
        )
    return "\n".join(out) + "\n"


def _search_target(s, L: int, fixed: Tuple[int, ...], cross: bool, n_stages: int) -> int:
    """The F count the search stops at: search.target_f, else round(search.ratio * L), never below the kept F
    layers `fixed`. Raises PlanError (naming the field and the fix) for a ratio or target out of range."""
    if s.target_f is not None:
        target = s.target_f
    else:
        if not 0 < s.ratio <= 1:
            raise PlanError(f"search.ratio={s.ratio}: must lie in (0, 1]. Fix: e.g. search.ratio=0.25.")
        target = max(len(fixed), round(s.ratio * L))
    if not len(fixed) <= target <= L:
        kept = "layer 0 stays F" if cross else f"each of the {n_stages} stages keeps its first layer F"
        raise PlanError(
            f"search.target_f={target}: must lie in {len(fixed)}..{L} ({kept}). Fix: choose a target in that range"
            + ("." if cross else ", or pipeline.cross_stage_indices=true to let stages open on S.")
        )
    return target


def _steps_csv(steps: List[Step], L: int, starts) -> str:
    """search.csv: one row per step of the greedy search."""
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["step", "removed_layer", "num_f", "f_ratio", "calib_loss", "calib_acc", "layout"])
    for st in steps:
        removed, acc = "" if st.removed is None else st.removed, "" if math.isnan(st.acc) else f"{st.acc:.4f}"
        w.writerow(
            [
                st.step,
                removed,
                st.num_f,
                f"{st.num_f / L:.4f}",
                f"{st.loss:.6f}",
                acc,
                format_layout(tuple(st.roles), starts),
            ]
        )
    return table.getvalue()


def _write_eval(out, s, run_cfg, ckpt, evaluator_of, steps: List[Step], starts, fixed) -> List[dict]:
    """Score all-F, uniform and searched patterns on search.eval_batches (`s.eval_batches`) held-out batches into
    out/eval.json and out/eval.md -> the table's rows ([] without eval batches). evaluator_of(batches): a
    PatternEvaluator of the searched model on those batches."""
    if not s.eval_batches:
        return []
    vb, _ = _batches(run_cfg, s.eval_batches, calib=False)
    rows = eval_table(evaluator_of(vb), steps, starts, s.eval_ratios, fixed)
    if run_cfg.data.kind == "text":  # byte tokens: bits per byte = nats per byte / ln 2
        for r in rows:
            r["bpb"] = r["loss"] / math.log(2)
    record = {"checkpoint": str(ckpt), "eval_batches": s.eval_batches, "rows": rows}
    atomic_write(out / "eval.json", json.dumps(record, indent=2) + "\n")
    atomic_write(out / "eval.md", _md_table(rows, starts))
    return rows


def run_search(cfg) -> int:
    """The `dsaflow search` command (parent process, no torchrun). Returns 0."""
    from dsaflow.pipeline.devices import resolve_device_type

    s = cfg.search
    if s.calib_batches < 1 or s.eval_batches < 0:
        raise PlanError(
            f"search.calib_batches={s.calib_batches} / search.eval_batches={s.eval_batches}: need >= 1 "
            "calibration batch and >= 0 eval batches. Fix: e.g. search.calib_batches=8."
        )
    dev = torch.device(resolve_device_type(s.device))
    torch.set_num_threads(max(1, cfg.train.cpu_threads)) if dev.type == "cpu" else None
    run_cfg, plan, stages, ckpt = load_search_model(cfg, dev)
    L, starts, cross = plan.num_layers, stage_starts_of(plan), bool(cfg.pipeline.cross_stage_indices)
    fixed = kept_f(plan, cross)
    target = _search_target(s, L, fixed, cross, len(starts))
    floor = min([target] + [max(len(fixed), round(r * L)) for r in s.eval_ratios])  # far enough for the eval table
    # its own folder, which may sit in the run dir (the default), never onto the run's files or a checkpoint
    out = check_output_dir(
        "search.out_dir", s.out_dir or ckpt.parent.parent / "search", {"checkpoint": str(ckpt)}, True
    )
    out.mkdir(parents=True, exist_ok=True)
    t = run_cfg.train
    header = {
        "checkpoint": str(ckpt.resolve()),
        "stage_starts": list(starts),
        "num_layers": L,
        "calib_batches": s.calib_batches,
        "seq_len": t.seq_len,
        "batch_size": t.batch_size,
        "seed": t.seed,
        "data": run_cfg.data.name,
    }
    if cross:  # only then: logs of searches without crossing keep their header
        header["cross_stage_indices"] = True
    log = SearchLog(out / "search.jsonl", header, restart=s.restart)
    kept = "only layer 0 kept F: cross-stage indices" if cross else "kept F"
    batches_said = f"{s.calib_batches} calibration batches of {t.batch_size}x{t.seq_len}"
    print(
        f"search: {L} layers, stages start at {list(starts)} ({kept}), target {target} F ({target / L:.2f}), "
        f"{batches_said} on {dev.type}; log {out / 'search.jsonl'}",
        flush=True,
    )
    t0 = time.perf_counter()
    batches, nq = _batches(run_cfg, s.calib_batches, calib=True)
    evaluator_of = lambda b: PatternEvaluator(stages, b, dev, nq, cross_stage=cross)
    ev = evaluator_of(batches)
    steps = greedy_search(ev, fixed, floor, log, report=lambda m: print(m, flush=True))
    search_s = time.perf_counter() - t0
    chosen = next((st for st in steps if st.num_f == target), steps[-1])
    atomic_write(out / "search.csv", _steps_csv(steps, L, starts))
    title = f"IndexCache greedy search: {ckpt.parent.parent.name}\n{L} layers, {batches_said}"
    steps_f, losses, removed = [st.num_f for st in steps], [st.loss for st in steps], [st.removed for st in steps]
    png_note = write_search_png(out / "search.png", steps_f, losses, removed, title)
    if png_note:
        print(f"search: note: {png_note}", file=sys.stderr, flush=True)
    rows = _write_eval(out, s, run_cfg, ckpt, evaluator_of, steps, starts, fixed)
    layout = format_layout(tuple(chosen.roles), starts)
    atomic_write(out / "layout.txt", layout + "\n")
    wrote = ", ".join(["search.csv"] + ([] if png_note else ["search.png"]) + (["eval.md"] if rows else []))
    print(f"search: done in {search_s:.0f} s ({ev.layer_calls} layer forwards); wrote {out}/{wrote}", flush=True)
    if rows:
        print(f"eval on {s.eval_batches} held-out batches:\n" + _md_table(rows, starts), flush=True)
    crossing = cross and any(chosen.roles[b] == "S" for b in starts[1:])
    print(f'layout="{layout}"' + (" pipeline.cross_stage_indices=true" if crossing else ""), flush=True)
    return 0
