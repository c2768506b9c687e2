"""IndexCache quality table on the harder retrieval task: train, search, evaluate, collect (JSON + markdown).

    python scripts/quality_table.py train   [--seeds 0 1 2] [--kinds all_full every4] [--steps 600]
    python scripts/quality_table.py search  [--seeds 0 1 2]      # greedy search + eval table on each all-F run
    python scripts/quality_table.py collect [--seeds 0 1 2]      # -> runs/quality/quality.json + quality.md

Rows (eval loss and exact-match accuracy, mean and spread over seeds, on held-out batches):
  all-F, uniform 1/2 and 1/4, searched 1/2 and 1/4   training-free, from each all-F checkpoint (`dsaflow search`)
  distilled uniform 1/4                               trained with index=every4 (IndexCache distillation)
Every step skips what is already done (a finished run dir, a finished search), so rerunning resumes. Outputs live
under runs/quality/ (not in git); docs/search.md holds the table of one measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's dsaflow, whatever else is installed
ROOT = REPO / "runs" / "quality"
TASK = [
    "data=retrieval_hard",
    "train.seq_len=128",
    "model.index_topk=16",
    "train.eval_every=100",
    "train.eval_batches=8",
    "train.log_every=50",
    "train.cpu_threads=1",
    "track=none",
    "train.progress=lines",
]


def dsaflow(*args: str, log: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("a") as f:
        return subprocess.call(
            [sys.executable, "-m", "dsaflow.cli", *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
        )


def run_dir(kind: str, seed: int) -> Path:
    return ROOT / f"{kind}-s{seed}"


def finished(rd: Path) -> bool:
    return any((rd / "checkpoints").glob("step-*/.metadata")) if (rd / "checkpoints").is_dir() else False


def cmd_train(a) -> None:
    """Train every (seed, kind) not finished yet. Several drivers may run at once: each run is claimed with a lock
    file (runs/quality/<name>.lock), so drivers share the work instead of repeating it."""
    ROOT.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds:
        for kind in a.kinds:
            rd = run_dir(kind, seed)
            if finished(rd):
                print(f"{rd.name}: done already", flush=True)
                continue
            lock = ROOT / f"{rd.name}.lock"
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
            except FileExistsError:
                print(f"{rd.name}: claimed by another driver ({lock})", flush=True)
                continue
            if rd.exists():
                import shutil

                shutil.rmtree(rd)
            print(f"{rd.name}: training", flush=True)
            rc = dsaflow(
                "train",
                *TASK,
                f"index={kind}",
                f"train.seed={seed}",
                f"train.steps={a.steps}",
                f"run_dir={rd}",
                log=ROOT / f"{rd.name}.log",
            )
            print(f"{rd.name}: exit {rc}", flush=True)
            if rc != 0:
                lock.unlink()


def cmd_search(a) -> None:
    for seed in a.seeds:
        rd = run_dir("all_full", seed)
        if not finished(rd):
            print(f"{rd.name}: not trained yet", flush=True)
            continue
        rc = dsaflow(
            "search",
            f"search.checkpoint={rd}",
            "search.ratio=0.25",
            "search.calib_batches=8",
            "search.eval_batches=32",
            "train.cpu_threads=1",
            log=ROOT / f"{rd.name}-search.log",
        )
        print(f"{rd.name}: search exit {rc}", flush=True)


def _distilled_eval(rd: Path, batches: int) -> dict:
    """Eval loss/acc of a run trained with its own (S-layer) layout, on the same held-out batches as the table."""
    import torch

    from dsaflow.config.compose import load_config
    from dsaflow.data import BatchSource
    from dsaflow.plan.plan import Plan
    from dsaflow.run.stages import build_stages
    from dsaflow.search.evaluate import PatternEvaluator
    from dsaflow.serve.weights import load_model_weights

    cfg = load_config(rd / "config.yaml")
    plan = Plan.from_json((rd / "plan.json").read_text())
    stages = build_stages(cfg.model, plan)
    load_model_weights({i: m for i, m in enumerate(stages)}, rd, cfg.model)
    for m in stages:
        m.eval()
    t = cfg.train
    data = BatchSource(cfg.data, t.seq_len, t.batch_size, t.seed, cfg.model.vocab_size)
    ev = PatternEvaluator(
        stages, [data.val_batch(i) for i in range(batches)], torch.device("cpu"), cfg.data.num_queries
    )
    roles = tuple(l.role for l in plan.layers)
    sc = ev.rebase(roles)
    return {
        "pattern": "distilled uniform 1/4",
        "roles": "".join(roles),
        "num_f": roles.count("F"),
        "loss": sc.loss,
        "acc": sc.acc,
    }


def _mean_sd(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def cmd_collect(a) -> None:
    import torch

    torch.set_num_threads(1)
    per_pattern: dict = {}
    seeds_used = []
    for seed in a.seeds:
        ev = run_dir("all_full", seed) / "search" / "eval.json"
        if not ev.is_file():
            print(f"seed {seed}: no search eval yet ({ev})", flush=True)
            continue
        seeds_used.append(seed)
        for r in json.loads(ev.read_text())["rows"]:
            per_pattern.setdefault(r["pattern"], []).append({"seed": seed, **r})
        rd = run_dir("every4", seed)
        if finished(rd):
            per_pattern.setdefault("distilled uniform 1/4", []).append({"seed": seed, **_distilled_eval(rd, 32)})
    base = {r["seed"]: r for r in per_pattern.get("all-F", [])}
    for runs in per_pattern.values():  # paired with the all-F model of the same seed (same held-out batches)
        for r in runs:
            b = base.get(r["seed"])
            r["d_loss"] = r["loss"] - b["loss"] if b else float("nan")
            r["d_acc_points"] = 100 * (r["acc"] - b["acc"]) if b else float("nan")
    order = ["all-F", "uniform 1/2", "searched 1/2", "uniform 1/4", "searched 1/4", "distilled uniform 1/4"]
    rows = []
    for name in order + sorted(set(per_pattern) - set(order)):
        runs = per_pattern.get(name, [])
        if not runs:
            continue
        lm, ls = _mean_sd([r["loss"] for r in runs])
        am, asd = _mean_sd([r["acc"] for r in runs])
        dlm, dls = _mean_sd([r["d_loss"] for r in runs])
        dam, das = _mean_sd([r["d_acc_points"] for r in runs])
        rows.append(
            {
                "pattern": name,
                "seeds": [r["seed"] for r in runs],
                "loss_mean": lm,
                "loss_sd": ls,
                "acc_mean": am,
                "acc_sd": asd,
                "d_loss_mean": dlm,
                "d_loss_sd": dls,
                "d_acc_points_mean": dam,
                "d_acc_points_sd": das,
                "per_seed": runs,
            }
        )
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "quality.json").write_text(json.dumps({"task": TASK, "rows": rows}, indent=2) + "\n")
    md = [
        "| pattern | seeds | eval loss (mean ± sd) | eval acc (mean ± sd) | Δ loss vs all-F | Δ acc vs all-F "
        "(points) | per-seed acc | per-seed layouts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        accs = " / ".join(f"{x['acc']:.3f}" for x in r["per_seed"])
        lays = (
            " / ".join(x["roles"] for x in r["per_seed"])
            if len({x["roles"] for x in r["per_seed"]}) > 1
            else r["per_seed"][0]["roles"]
        )
        md.append(
            f"| {r['pattern']} | {len(r['seeds'])} | {r['loss_mean']:.3f} ± {r['loss_sd']:.3f} | "
            f"{r['acc_mean']:.3f} ± {r['acc_sd']:.3f} | {r['d_loss_mean']:+.3f} ± {r['d_loss_sd']:.3f} | "
            f"{r['d_acc_points_mean']:+.1f} ± {r['d_acc_points_sd']:.1f} | {accs} | {lays} |"
        )
    text = "\n".join(md) + "\n"
    (ROOT / "quality.md").write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("train", "search", "collect"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kinds", nargs="+", default=["all_full", "every4"])
    ap.add_argument("--steps", type=int, default=600)
    a = ap.parse_args()
    {"train": cmd_train, "search": cmd_search, "collect": cmd_collect}[a.phase](a)


if __name__ == "__main__":
    main()
