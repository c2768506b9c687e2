"""IndexCache quality table: which layers can share their indexer, and what it costs (docs/quality.md).

    python scripts/quality_table.py probe   --device cuda [--task retrieval_long] [--steps N]   # all-F, acc over time
    python scripts/quality_table.py run     --device cuda --task retrieval_long --seeds 0 1 2 [--budget-s 500]
    python scripts/quality_table.py collect runs/quality-cuda [more result dirs]  # -> docs/quality.json, quality.md

`run` does, for each seed of one task, two independent steps with the normal `dsaflow train` / `dsaflow search`
commands (subprocesses):
  base    train all-F, then `dsaflow search` on it (greedy to 1/4 of the layers): rows all-F, uniform 1/2 and 1/4
          (training-free), searched 1/2 and 1/4, every one scored on the same held-out batches;
  every4  train `index=every4` from scratch: the indexer only on every 4th layer (S layers have none, as in
          GLM-5.2's IndexShare), each F layer distilled on the mean attention of itself and the 3 S layers it serves
          (IndexCache's multi-layer target): row "every4 trained", scored on the same batches.
Each step writes one small JSON per row (<out>/results/<task>-s<seed>-<row>.json), then deletes its checkpoints;
a step whose JSONs all exist is skipped, so running the same command again resumes. `--budget-s` stops before a
step that would not finish in the time left (estimated from the slowest measured run of that step, kept in
<out>/timings.json, else the preset's guess) and kills a step still running at the limit (it reruns next time, from
its last finished training); exit status 75 says work is left.
`--parallel N` runs N steps at once, one GPU each (CUDA_VISIBLE_DEVICES). `--pre-stage "STEPS:SEQ_LEN[:OVERRIDES]"`
(repeatable) trains a curriculum before the task length: each pre-stage STEPS steps at SEQ_LEN tokens with dense
attention (top-k = SEQ_LEN) and its own space-separated overrides, each from the weights of the one before. One
curriculum per task and seed serves both steps (dense attention reads no indices, so the layout does not change it):
the all-F and every4 task-length runs both start from its last stage (train.init_from).

Presets (`--preset`, default: gpu with --device cuda, cpu with --device cpu) fix the recipe; flags override it.
Text: the Python standard library's *.py files of this interpreter (site-packages excluded), whole files held out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the collect step lives in quality_collect.py; its names are re-exported for the tests
from quality_collect import (  # noqa: F401
    BEGIN,
    END,
    ORDER,
    ROW_CONTINUED,
    ROW_EVERY4,
    ROWS_BASE,
    cmd_collect,
    collect_rows,
)

# the recipes (presets, the curriculum, the train overrides) live in quality_recipe.py
from quality_recipe import (  # noqa: F401
    PRESETS,
    pre_stage,
    recipe,
    stdlib_dir,
    task_overrides,
    train_overrides,
)

REPO = Path(__file__).resolve().parents[1]
EXIT_WORK_LEFT = 75


class Budget:
    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds
        self.hit = threading.Event()

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


T0 = time.monotonic()
_print_lock = threading.Lock()


def say(msg: str) -> None:
    with _print_lock:
        print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)


def shown(line: str) -> bool:
    """The progress worth a line on screen: evaluations, each search step's choice, failures."""
    search_step = line.startswith("search: step") and "candidate" not in line
    return search_step or any(k in line for k in (" eval_acc=", " eval_loss=", "eval-run:", "Error", "error:"))


def call(args: list, log: Path, budget: Budget, env_extra: dict, tag: str) -> int:
    """Run `args` (a new session, so a budget kill reaches torchrun's workers), append its output to `log`, echo
    the lines that show progress. Returns its exit status, or None when the budget ran out and it was stopped."""
    # this checkout first, then whatever the caller's PYTHONPATH adds (packages installed outside site-packages)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env_extra}
    if "track=offline" in args:
        env["WANDB_MODE"] = "offline"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(args)}\n")
        f.flush()
        p = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        timer = threading.Timer(max(budget.left(), 0.0), lambda: _stop(p, budget)) if budget.end else None
        if timer:
            timer.daemon = True
            timer.start()
        for line in p.stdout:
            f.write(line)
            if shown(line):
                say(f"{tag}: {line.rstrip()}")
        rc = p.wait()
        if timer:
            timer.cancel()
    return None if budget.hit.is_set() and rc != 0 else rc


def _stop(p: subprocess.Popen, budget: Budget) -> None:
    budget.hit.set()
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)  # the group this script started for this step, nothing else
            p.wait(wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def dsaflow_cmd(*args: str) -> list:
    return [sys.executable, "-m", "dsaflow.cli", *args]


def finished(rd: Path) -> bool:
    return (rd / "checkpoints").is_dir() and any((rd / "checkpoints").glob("step-*/manifest.json"))


def slug(pattern: str) -> str:
    return pattern.replace(" ", "-").replace("/", "_")


def result_path(out: Path, task: str, seed: int, pattern: str) -> Path:
    return out / "results" / f"{task}-s{seed}-{slug(pattern)}.json"


def final_eval(rd: Path) -> dict:
    """The trainer's own last evaluation and the median tokens/s (bf16 on GPU, train.eval_batches batches)."""
    from dsaflow.track.sweep_summary import final_metrics

    m = final_metrics(rd)
    return {k: m[k] for k in ("step", "eval_loss", "eval_acc", "eval_bpb", "tokens_per_s") if k in m}


def _row(out, task, seed, pattern, roles, loss, acc, extra) -> None:
    row = {"task": task, "seed": seed, "pattern": pattern, "roles": roles, "num_f": roles.count("F"), "loss": loss}
    row["acc"] = None if acc is None or acc != acc else acc
    if task == "text":
        row["bpb"] = loss / math.log(2)
    p = result_path(out, task, seed, pattern)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({**row, **extra}, indent=1) + "\n")
    tmp.replace(p)  # a row file exists only complete


def train(a, r, out, task, seed, index, budget, env, tag, name=None, steps=None, more=()) -> tuple:
    """-> (run dir, wall seconds) or (None, None) when stopped or failed. name: the run dir's suffix (default the
    index); steps: default the recipe's (every4: --every4-steps); more: extra overrides (train.init_from=...)."""
    rd = out / "runs" / f"{task}-s{seed}-{name or index}"
    if finished(rd):
        say(f"{tag}: training done already ({rd})")
        return rd, None
    if rd.exists():
        shutil.rmtree(rd)  # an interrupted run: its checkpoints (if any) did not survive the call, start again
    steps = steps or (a.every4_steps if (index == "every4" and a.every4_steps) else r["steps"])
    t = time.monotonic()
    if r.get("pre_stages") and not more:  # a model trained from scratch: its curriculum first
        last = pre_stages(a, r, out, task, seed, budget, env, tag, name or CURRICULUM)
        if last is None:
            return None, None
        more = (f"train.init_from={last}",)
    say(f"{tag}: training index={index}, {steps} steps -> {rd}")
    rc = call(
        dsaflow_cmd("train", *train_overrides(a, r, task, seed, index, rd, steps), *more),
        rd.parent / f"{rd.name}.log",
        budget,
        env,
        tag,
    )
    if rc != 0:
        say(
            f"{tag}: training {'stopped at the time budget' if rc is None else f'failed (exit {rc})'}; "
            f"log {rd.parent / f'{rd.name}.log'}"
        )
        return None, None
    return rd, time.monotonic() - t


CURRICULUM = "curriculum"  # run-dir prefix of a seed's pre-stages, shared by its all-F and every4 models
_curriculum_locks: dict = {}
_curriculum_locks_guard = threading.Lock()


def _curriculum_lock(out: Path, task: str, seed: int, prefix: str) -> threading.Lock:
    with _curriculum_locks_guard:
        return _curriculum_locks.setdefault((str(out), task, seed, prefix), threading.Lock())


def pre_stages(a, r, out, task, seed, budget, env, tag, prefix):
    """The curriculum before a from-scratch training (`--pre-stage`): each stage its steps at its length with dense
    attention (top-k = that length) and its overrides, from the previous stage's weights; the task-length run starts
    from the last (train.init_from). -> the last stage's run dir, None when stopped or failed.

    The stages train index=all_full under the run-dir prefix (`run`: CURRICULUM, one curriculum per task and seed).
    Dense attention reads no indices, so the main model learns the same whatever the layout; the all-F and every4
    models of a seed therefore start their task-length runs from the same weights (every4 drops its S layers'
    indexers there), and differ only in what the layout changes. One step runs the stages while the other waits on
    the lock; a finished stage is kept, and reused after an interruption, until the seed's every step is done
    (`drop_curriculum`)."""
    prev = None
    with _curriculum_lock(out, task, seed, prefix):
        for i, st in enumerate(r["pre_stages"]):
            rd = out / "runs" / f"{task}-s{seed}-{prefix}-pre{i}"
            if not finished(rd):
                shutil.rmtree(rd, ignore_errors=True)
                rs = dict(r, seq_len=st["seq_len"], topk=st["seq_len"])
                say(f"{tag}: pre-stage {i} index=all_full, {st['steps']} steps at {st['seq_len']} tokens -> {rd}")
                overrides = train_overrides(a, rs, task, seed, "all_full", rd, st["steps"]) + st["overrides"]
                overrides += [f"train.init_from={prev}"] if prev else []
                rc = call(dsaflow_cmd("train", *overrides), rd.parent / f"{rd.name}.log", budget, env, tag)
                if rc != 0:
                    say(f"{tag}: pre-stage {i} {'stopped at the time budget' if rc is None else f'failed (exit {rc})'}")
                    return None
            prev = rd
    return prev


def drop_curriculum(out: Path, task: str, seed: int) -> None:
    """The seed's shared pre-stage run dirs (`pre_stages`), once no step of the seed needs them."""
    for pre in (out / "runs").glob(f"{task}-s{seed}-{CURRICULUM}-pre*"):
        shutil.rmtree(pre, ignore_errors=True)


def drop_checkpoints(rd: Path) -> None:
    """A finished step's checkpoints, and its pre-stages' run dirs."""
    shutil.rmtree(rd / "checkpoints", ignore_errors=True)
    for pre in rd.parent.glob(f"{rd.name}-pre*"):
        if pre.is_dir():
            shutil.rmtree(pre, ignore_errors=True)


def step_base(a, r, out, task, seed, budget, env) -> bool:
    tag = f"{task} s{seed} base"
    rd, train_s = train(a, r, out, task, seed, "all_full", budget, env, tag)
    if rd is None:
        return False
    sd = rd / "search"
    if not (sd / "eval.json").is_file():
        say(
            f"{tag}: dsaflow search (greedy to 1/4, {r['calib_batches']} calibration, {r['eval_batches']} eval batches)"
        )
        args = [
            "search",
            f"search.checkpoint={rd}",
            "search.ratio=0.25",
            "search.eval_ratios=[0.5,0.25]",
            f"search.calib_batches={r['calib_batches']}",
            f"search.eval_batches={r['eval_batches']}",
            f"search.device={a.device}",
            "train.cpu_threads=1",
        ]
        rc = call(dsaflow_cmd(*args), rd.parent / f"{rd.name}-search.log", budget, env, tag)
        if rc != 0:
            say(f"{tag}: search {'stopped at the time budget' if rc is None else f'failed (exit {rc})'}")
            return False
    table = json.loads((sd / "eval.json").read_text())
    extra = {"train": {**final_eval(rd), "wall_s": train_s}, "eval_batches": r["eval_batches"], "recipe": r}
    extra["overrides"] = train_overrides(a, r, task, seed, "all_full", rd, r["steps"])
    if a.continued_steps and not result_path(out, task, seed, ROW_CONTINUED).is_file():
        if not continued(a, r, out, task, seed, rd, budget, env, tag):
            return False
    for row in table["rows"]:
        _row(out, task, seed, row["pattern"], row["roles"], row["loss"], row["acc"], extra)
    drop_checkpoints(rd)
    return True


def continued(a, r, out, task, seed, base_rd, budget, env, tag) -> bool:
    """The IndexCache paper's training-aware setting: the all-F model trained on with index=every4 for
    --continued-steps steps (`train.init_from`: fresh optimiser; the S layers drop their indexers)."""
    more = (f"train.init_from={base_rd}",)
    rd, train_s = train(a, r, out, task, seed, "every4", budget, env, tag, "every4_continued", a.continued_steps, more)
    e = rd and eval_own(a, r, rd, budget, env, tag)
    if not e:
        return False
    extra = {"train": {**final_eval(rd), "wall_s": train_s}, "eval_batches": r["eval_batches"], "recipe": r}
    extra["overrides"] = [*train_overrides(a, r, task, seed, "every4", rd, a.continued_steps), *more]
    _row(out, task, seed, ROW_CONTINUED, e["roles"], e["loss"], e["acc"], extra)
    drop_checkpoints(rd)
    return True


def eval_own(a, r, rd: Path, budget, env, tag):
    """A trained run scored with its own layout on the table's held-out batches -> its eval dict, None on failure."""
    ev = rd / "eval_own.json"
    if not ev.is_file():
        args = [sys.executable, __file__, "eval-run", str(rd), "--batches", str(r["eval_batches"])]
        rc = call([*args, "--device", a.device, "--out", str(ev)], rd.parent / f"{rd.name}-eval.log", budget, env, tag)
        if rc != 0:
            say(f"{tag}: eval {'stopped at the time budget' if rc is None else f'failed (exit {rc})'}")
            return None
    return json.loads(ev.read_text())


def step_every4(a, r, out, task, seed, budget, env) -> bool:
    tag = f"{task} s{seed} every4"
    rd, train_s = train(a, r, out, task, seed, "every4", budget, env, tag)
    if rd is None:
        return False
    e = eval_own(a, r, rd, budget, env, tag)
    if e is None:
        return False
    extra = {"train": {**final_eval(rd), "wall_s": train_s}, "eval_batches": r["eval_batches"], "recipe": r}
    extra["overrides"] = train_overrides(a, r, task, seed, "every4", rd, a.every4_steps or r["steps"])
    _row(out, task, seed, ROW_EVERY4, e["roles"], e["loss"], e["acc"], extra)
    drop_checkpoints(rd)
    return True


STEPS = {"base": (step_base, ROWS_BASE), "every4": (step_every4, (ROW_EVERY4,))}


def cmd_run(a) -> int:
    r = recipe(a)
    out = Path(a.out or REPO / "runs" / f"quality-{a.device}").resolve()
    budget = Budget(a.budget_s)
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}

    def rows_of(kind):
        return STEPS[kind][1] + ((ROW_CONTINUED,) if kind == "base" and a.continued_steps else ())

    def seed_done(seed):
        return all(result_path(out, a.task, seed, p).is_file() for k in a.steps_to_run for p in rows_of(k))

    todo = []
    # every seed's first step before any second one: with pre-stages the second waits for the curriculum the first
    # trains, and a slot it holds while waiting should not keep another seed's curriculum from starting
    for kind in a.steps_to_run:
        for seed in a.seeds:
            if all(result_path(out, a.task, seed, p).is_file() for p in rows_of(kind)):
                say(f"{a.task} s{seed} {kind}: done already")
            else:
                todo.append((seed, kind))
    say(f"{a.task}: {len(todo)} step(s) to run on {a.device} (recipe {json.dumps(r)}); results in {out}/results")
    slots = list(range(max(1, a.parallel)))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # slot i -> the (i // per_gpu)-th GPU this process may use: small models leave a GPU mostly idle (launch-bound),
    # so several steps can share one (on an H200, six model=small trainings at once each kept about 80 % of the tokens/s one ran alone)
    gpus = visible.split(",") if visible else [str(i) for i in range(len(slots))]
    if a.device == "cuda" and a.parallel > len(gpus) * a.per_gpu:
        print(
            f"--parallel {a.parallel} needs {-(-a.parallel // a.per_gpu)} GPUs at --per-gpu {a.per_gpu}, "
            f"CUDA_VISIBLE_DEVICES={visible}; raise --per-gpu or lower --parallel",
            file=sys.stderr,
        )
        return 2
    lock = threading.Lock()
    left = []

    def work(item):
        seed, kind = item
        key = f"{a.task}/{kind}"
        need = timings.get(key, r["guess_s"][kind])
        if budget.left() < need:
            say(f"{a.task} s{seed} {kind}: not started, {budget.left():.0f} s left < {need:.0f} s it needs")
            left.append(item)
            return
        with lock:
            slot = slots.pop(0)
        env = {"CUDA_VISIBLE_DEVICES": gpus[slot // a.per_gpu]} if (a.device == "cuda" and a.parallel > 1) else {}
        t = time.monotonic()
        try:
            ok = STEPS[kind][0](a, r, out, a.task, seed, budget, env)
        finally:
            with lock:
                slots.append(slot)
        dt = time.monotonic() - t
        if ok:
            with lock:
                timings[key] = max(dt, timings.get(key, 0.0))  # the slowest seen: a safe estimate
                out.mkdir(parents=True, exist_ok=True)
                timings_file.write_text(json.dumps(timings, indent=1) + "\n")
            say(f"{a.task} s{seed} {kind}: done in {dt:.0f} s")
            if seed_done(seed):
                drop_curriculum(out, a.task, seed)
        else:
            left.append(item)

    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        list(pool.map(work, todo))
    for ck in (out / "runs").glob("*/checkpoints"):  # an unfinished run's: it starts over next time, keep `out` small
        if not finished(ck.parent):  # a finished run (a pre-stage, a trained model awaiting search) is reused
            shutil.rmtree(ck, ignore_errors=True)
    if left:
        say(f"{len(left)} step(s) left ({', '.join(f's{s} {k}' for s, k in sorted(left))}): run the same command again")
        return EXIT_WORK_LEFT
    say(f"{a.task}: every step done; merge with: python scripts/quality_table.py collect {out}")
    return 0


def cmd_probe(a) -> int:
    """Train all-F with the run recipe (its pre-stages first with --pre-stage) and print eval accuracy (or bits per
    byte) over time."""
    r = recipe(a)
    out = Path(a.out or REPO / "runs" / f"quality-probe-{a.device}").resolve()
    name = f"all_full-{time.strftime('%H%M%S')}"
    say(f"probe: {a.task}, recipe {json.dumps(r)}")
    rd, _ = train(a, r, out, a.task, a.seeds[0], "all_full", Budget(a.budget_s), {}, "probe", name=name)
    done = rd is not None
    rd = out / "runs" / f"{a.task}-s{a.seeds[0]}-{name}"
    drop_checkpoints(rd)
    say(f"probe: {'done' if done else 'stopped or failed'}; {final_eval(rd)}")
    return 0 if done else 1


def cmd_eval_run(a) -> int:
    """Loss/acc of a trained run with its own layout on the held-out batches `dsaflow search` scores (same data
    config, seed, batch size), fp32 like the search."""
    import torch

    from dsaflow.checkpoint.weights import load_model_weights
    from dsaflow.config.compose import load_config
    from dsaflow.data import BatchSource
    from dsaflow.pipeline.stages import build_stages
    from dsaflow.plan.plan import Plan
    from dsaflow.search.evaluate import PatternEvaluator

    torch.set_num_threads(1)
    rd = Path(a.run_dir)
    cfg = load_config(rd / "config.yaml")
    plan = Plan.from_json((rd / "plan.json").read_text())
    stages = build_stages(cfg.model, plan)
    load_model_weights({i: m for i, m in enumerate(stages)}, rd, cfg.model)
    dev = torch.device(a.device)
    for m in stages:
        m.to(dev).eval()
    t = cfg.train
    data = BatchSource(cfg.data, t.seq_len, t.batch_size, t.seed, cfg.model.vocab_size)
    nq = cfg.data.num_queries if data.has_answers else 0
    ev = PatternEvaluator(stages, [data.val_batch(i) for i in range(a.batches)], dev, nq)
    roles = "".join(l.role for l in plan.layers)
    sc = ev.rebase(tuple(roles))
    res = {"roles": roles, "loss": sc.loss, "acc": None if sc.acc != sc.acc else sc.acc, "batches": a.batches}
    Path(a.out).write_text(json.dumps(res) + "\n")
    print(f"eval-run: {rd.name} {roles} loss {sc.loss:.4f} acc {sc.acc:.4f}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    for name in ("run", "probe"):
        p = sub.add_parser(name)
        p.add_argument("--device", choices=("cuda", "cpu"), required=True)
        p.add_argument("--task", choices=("retrieval_long", "text"), default="retrieval_long")
        p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="default: gpu on cuda, cpu on cpu")
        p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2] if name == "run" else [0])
        p.add_argument("--out", default=None, help="default runs/quality-<device> (probe: runs/quality-probe-<device>)")
        p.add_argument("--budget-s", type=float, default=None, help="stop cleanly before this many seconds pass")
        p.add_argument("--steps", type=int, default=None, help="training steps (all-F and every4)")
        p.add_argument("--every4-steps", type=int, default=None, help="training steps of every4 (default --steps)")
        p.add_argument(
            "--continued-steps",
            type=int,
            default=0,
            help="also train the all-F model on with index=every4 for this many steps (row 'every4 continued')",
        )
        p.add_argument(
            "--pre-stage",
            dest="pre_stages",
            type=pre_stage,
            action="append",
            default=None,
            metavar="STEPS:SEQ_LEN[:OVERRIDES]",
            help="repeatable: train each model from scratch first through these stages in order, each STEPS steps at "
            "SEQ_LEN tokens, dense (top-k = SEQ_LEN), with its own space-separated overrides, from the previous "
            "stage's weights; then the task length from the last (train.init_from). Replaces the preset's "
            "curriculum (gpu, retrieval_long: docs/quality.md); `--pre-stage none`: no curriculum",
        )
        for k, t in (
            ("seq-len", int),
            ("topk", int),
            ("batch-size", int),
            ("lr", float),
            ("warmup", int),
            ("eval-batches", int),
            ("calib-batches", int),
        ):
            p.add_argument(f"--{k}", type=t, default=None)
        p.add_argument("--text-path", default=None, help="text task corpus (default: this Python's stdlib)")
        p.add_argument("--track", choices=("offline", "none"), default=None, help="default offline on cuda")
        p.add_argument("--set", nargs="*", default=[], help="extra overrides for every `dsaflow train`")
        if name == "run":
            p.add_argument("--parallel", type=int, default=1, help="steps at once (--per-gpu of them on each GPU)")
            p.add_argument("--per-gpu", type=int, default=1, help="steps sharing one GPU when --parallel > 1")
            p.add_argument("--only", dest="steps_to_run", nargs="+", choices=tuple(STEPS), default=list(STEPS))
    c = sub.add_parser("collect")
    c.add_argument("dirs", nargs="+")
    c.add_argument("--json", default=str(REPO / "docs" / "quality.json"))
    c.add_argument("--md", default=str(REPO / "docs" / "quality.md"))
    e = sub.add_parser("eval-run", help="(internal) score a trained run with its own layout")
    e.add_argument("run_dir")
    e.add_argument("--batches", type=int, required=True)
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return {"run": cmd_run, "probe": cmd_probe, "collect": cmd_collect, "eval-run": cmd_eval_run}[a.phase](a)


if __name__ == "__main__":
    sys.exit(main())
