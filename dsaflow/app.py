"""The `dsaflow` commands as a Hydra app, in the parent process only (workers never import Hydra).

Hydra's own flags go to Hydra's own machinery: `--cfg job|hydra|all [--resolve] [-p PKG]`, `--info [topic]`,
`--hydra-help`, `--shell-completion`, and `-m/--multirun`, where the configured sweeper (the basic sweeper by
default, or any sweeper plugin selected with `hydra/sweeper=...`) expands the sweep and Hydra's basic launcher runs
the jobs one after another, in this process. Each job is `job_task`: it turns Hydra's composed config into the
typed config, plans it and calls `launch(cfg, plan, job)` (its own run dir, its own torchrun). A job that fails
is recorded and returns; the sweep goes on, and `dsaflow.track.sweep_summary` writes the table at the end.

A plain single run does not start a Hydra app (Hydra would create its run dir before the plan is checked); it uses
the compose API (`dsaflow.config.compose.compose`), and `hydra.run.dir=DIR` is honoured as `run_dir=DIR`.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from dsaflow.errors import ConfigError, PlanError

# Flags Hydra owns; any of them (or -m) routes the command through Hydra's app runner.
HYDRA_COMMAND_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc", "-m", "--multirun")
# hydra.* overrides a single run understands (everything else under hydra. needs -m or is refused).
SWEEP_ONLY = ("hydra.sweep.", "hydra.sweeper", "hydra/sweeper", "hydra/launcher", "hydra.launcher")


@dataclass
class JobResult:
    num: int
    overrides: List[str]
    run_dir: Optional[str]
    status: str  # ok | failed (exit N) | config error | plan error | crashed
    exit_code: int
    error: Optional[str] = None
    seconds: float = 0.0


@dataclass
class SweepState:
    command: str
    nproc: Optional[int]
    fmt: str
    sweep_dir: Optional[str] = None
    planned: List[List[str]] = field(default_factory=list)  # the basic sweeper's jobs (for the rows not run)
    results: List[JobResult] = field(default_factory=list)
    objective: str = "eval_loss"  # what a job returns to an optimising sweeper (Optuna): lower is better
    wandb_group: Optional[str] = None  # the group jobs logged to; None while no job tracks with wandb


_STATE: Optional[SweepState] = None


def wants_hydra_app(rest: List[str]) -> bool:
    return any(a in HYDRA_COMMAND_FLAGS or a.split("=", 1)[0] in ("--cfg", "--info") for a in rest)


def split_hydra_overrides(overrides: List[str]) -> tuple[List[str], Dict[str, str]]:
    """Single run: (plain overrides, {hydra key: value}) for the `hydra.*` / `hydra/...` overrides."""
    plain, hyd = [], {}
    for ov in overrides:
        key = ov.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra.") or key.startswith("hydra/"):
            hyd[key] = ov.split("=", 1)[1] if "=" in ov else ""
        else:
            plain.append(ov)
    return plain, hyd


def single_run_dir(hyd: Dict[str, str], overrides: List[str]) -> Optional[str]:
    """Check the hydra.* overrides of a single run; -> the run dir that hydra.run.dir asks for (or None)."""
    for key in hyd:
        if key.startswith(SWEEP_ONLY):
            raise ConfigError(
                f"{key}=... configures a sweep, and this is a single run. Fix: add -m (--multirun), or drop it."
            )
        if key != "hydra.run.dir":
            raise ConfigError(
                f"{key}=...: a single dsaflow run uses no Hydra setting except hydra.run.dir (its run dir); "
                f"the others would be silently ignored. Fix: drop it (logging: see the run dir's train.log), or use "
                f"run_dir=DIR."
            )
    if "hydra.run.dir" in hyd:
        if any(o.lstrip("+").startswith("run_dir=") for o in overrides):
            raise ConfigError(
                "both run_dir=... and hydra.run.dir=... are given. Fix: keep one of them (they mean the "
                "same: the run dir)."
            )
        return hyd["hydra.run.dir"]
    return None


def _refuse_in_multirun(overrides: List[str]) -> None:
    for ov in overrides:
        key = ov.lstrip("+~").split("=", 1)[0]
        if key == "run_dir":
            raise ConfigError(
                "run_dir=... with -m would put every job of the sweep into one run dir. Fix: drop it; set the sweep's "
                "folder with hydra.sweep.dir=DIR (each job writes DIR/<job number>)."
            )
        if key == "hydra.run.dir":
            raise ConfigError(
                "hydra.run.dir=... names a single run's dir and is unused with -m. Fix: use "
                "hydra.sweep.dir=DIR (and hydra.sweep.subdir=...) for a sweep."
            )
        if key == "hydra.job.chdir" and ov.split("=", 1)[1].lower() == "true":
            raise ConfigError(
                "hydra.job.chdir=true would move every job into its output dir, breaking relative "
                "data and checkpoint paths. Fix: drop it (dsaflow never changes directory)."
            )


def preflight_basic_sweep(overrides: List[str]) -> List[List[str]]:
    """Basic sweeper: compose every distinct value of the sweep before any job starts (dsaflow.launch.sweep_guard),
    so a typo in one value stops the whole sweep (exit 2) instead of failing after earlier jobs trained. Returns
    the jobs' overrides."""
    from dsaflow.config.compose import compose, quote_layout_overrides
    from dsaflow.config.hydra_private import basic_sweep_jobs

    plain = [o for o in overrides if not o.lstrip("+~").split("=", 1)[0].startswith(("hydra.", "hydra/"))]
    try:
        jobs = basic_sweep_jobs(quote_layout_overrides(plain))
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar and sweep errors
        raise ConfigError(
            f"could not read the sweep: {' '.join(str(exc).split())} Fix: write sweeps as key=a,b,c, "
            "key='range(start,stop,step)' or key='choice(a,b)' (quoted for the shell)."
        ) from None
    from dsaflow.checkpoint.hf_config import apply_hf_model
    from dsaflow.launch.sweep_guard import check_jobs

    check_jobs(jobs, lambda job: compose(job, model_source=apply_hf_model))
    return jobs


# Sweeper plugins by name -> the pip package that provides `hydra/sweeper=<name>` (module hydra_plugins.<module>).
SWEEPER_PLUGINS = {"optuna": "hydra-optuna-sweeper", "ax": "hydra-ax-sweeper", "nevergrad": "hydra-nevergrad-sweeper"}


def check_sweeper_plugin(overrides: List[str]) -> None:
    """`hydra/sweeper=NAME` needs NAME's plugin installed; say which package, instead of Hydra's raw error."""
    import importlib.util

    for ov in overrides:
        key, _, name = ov.lstrip("+~").partition("=")
        if key != "hydra/sweeper" or name == "basic":
            continue
        package = SWEEPER_PLUGINS.get(name, f"hydra-{name}-sweeper")
        try:
            found = importlib.util.find_spec(f"hydra_plugins.hydra_{name}_sweeper") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"hydra/sweeper={name}: the {name} sweeper plugin is not installed. Fix: pip install {package} "
                f"(into the environment that runs dsaflow), or drop hydra/sweeper={name} to use the basic sweeper "
                "(key=a,b,c grids)."
            )


def _sweep_name(sweep_dir: str) -> str:
    return Path(sweep_dir).name


def job_task(cfg) -> float:
    """Hydra's task function for one multirun job. Never raises: failures are recorded (the sweep goes on).
    Returns the job's final eval loss (or training loss) for optimising sweepers; +inf when it failed."""
    from hydra.core.hydra_config import HydraConfig

    state = _STATE
    hc = HydraConfig.get()
    num = int(hc.job.num) if hc.job.get("num") is not None else len(state.results)
    overrides = [str(o) for o in hc.overrides.task if not str(o).startswith("hydra.")]
    run_dir = str(hc.runtime.output_dir)
    state.sweep_dir = state.sweep_dir or str(hc.sweep.dir)
    t0 = time.perf_counter()
    print(f"\n=== job {num}: {' '.join(overrides) or '(defaults)'} -> {run_dir}", flush=True)
    res = JobResult(num, overrides, run_dir, "ok", 0)
    try:
        from dsaflow.checkpoint.hf_config import apply_hf_model
        from dsaflow.config.compose import typed_config
        from dsaflow.plan import build_plan

        typed = typed_config(cfg, apply_hf_model)
        typed.run_dir = run_dir
        from dsaflow.config.from_run import settings_from_run

        typed = settings_from_run(typed, overrides, state.command)  # generate / search of a run: its model, layout
        if typed.track.group is None:
            typed.track.group = _sweep_name(state.sweep_dir)
        if str(typed.track.backend) == "wandb" and str(typed.track.mode) != "disabled" and state.command == "train":
            state.wandb_group = typed.track.group
        if typed.track.run_name is None:
            typed.track.run_name = f"{_sweep_name(state.sweep_dir)}-{num}"
        if state.command == "generate" and typed.mode != "serve" and not any(o.startswith("mode=") for o in overrides):
            typed.mode = "serve"
        from dsaflow.checkpoint.indexer_weights import plan_for_checkpoint

        plan = plan_for_checkpoint(typed, state.command, lambda c: build_plan(c, nproc=state.nproc))
        rc = run_command(state.command, typed, plan, state.fmt)
        res.exit_code = rc
        if rc != 0:
            res.status = f"{'interrupted' if rc > 128 else 'failed'} (exit {rc})"
    except KeyboardInterrupt as exc:  # SIGINT/SIGTERM/SIGHUP outside the launcher: this job, then the sweep, end
        res.status, res.exit_code = "interrupted", 128 + getattr(exc, "signum", 2)
        state.results.append(res)
        raise
    except PlanError as exc:
        kind = "config error" if isinstance(exc, ConfigError) else "plan error"
        res.status, res.exit_code, res.error = kind, 2, str(exc)
        print(f"dsaflow: error: job {num}: {exc}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - one job's crash must not end the sweep
        res.status, res.exit_code, res.error = "crashed", 1, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        print(f"dsaflow: job {num} crashed ({res.error}); the sweep goes on", file=sys.stderr, flush=True)
    res.seconds = time.perf_counter() - t0
    state.results.append(res)
    from dsaflow.launch.sweep_guard import after_job

    after_job(res.exit_code)  # interrupted: no further job starts (SweepStopped leaves Hydra's job loop)
    if res.exit_code != 0:
        return math.inf
    from dsaflow.track.sweep_summary import final_metrics

    m = final_metrics(run_dir)
    v = m.get(state.objective, m.get("loss"))
    return float(v) if v is not None else math.inf


def run_command(command: str, cfg, plan, fmt: str = "table") -> int:
    """What one job does once planned: print the plan, or launch train / generate, or run the search."""
    if command == "plan":
        from dsaflow.plan.render import render_table

        sys.stdout.write(plan.to_json() + "\n" if fmt == "json" else render_table(plan, cfg))
        sys.stdout.flush()  # the numbers above, then why they do not fit plan.device_memory_gib: exit 2
        if cfg.mode == "serve":
            from dsaflow.plan.serve_fit import check_serve_fit

            check_serve_fit(cfg, plan)
        else:
            from dsaflow.plan.train_fit import check_train_fit

            check_train_fit(cfg, plan)
        return 0
    if command == "search":
        from dsaflow.search.run import run_search

        return run_search(cfg)
    if command in ("generate", "serve") and not cfg.serve.checkpoint and not cfg.model.hf_path:  # hf_path: loads
        print(
            f"dsaflow {command}: WARNING: no serve.checkpoint and no model.hf_path: the weights are RANDOM and the "
            "output is noise. Fix: serve.checkpoint=runs/<a dsaflow train run>, or model=hf model.hf_path=DIR.",
            file=sys.stderr,
            flush=True,
        )
    if command == "serve":
        from dsaflow.launch.serve_launch import launch_serve

        return launch_serve(cfg, plan)
    from dsaflow.launch.launch import launch

    return launch(cfg, plan, command) or 0


def _remove_empty_sweep_dir(sweep_dir: Path, results: List[JobResult]) -> None:
    """`dsaflow plan -m` only prints: take back the folders Hydra made for its jobs (each empty), its
    multirun.yaml and the sweep's lock file, and the sweep dir and its parents below the working directory once nothing else is in them."""
    for r in results:
        if r.run_dir:
            try:
                Path(r.run_dir).rmdir()  # only an empty folder goes
            except OSError:
                pass
    from dsaflow.rundir.lock import LOCK

    ours = ("multirun.yaml", LOCK)  # Hydra's record of the sweep; the lock the sweep held (released by now)
    if sweep_dir.is_dir() and all(p.name in ours and p.is_file() and not p.is_symlink() for p in sweep_dir.iterdir()):
        for name in ours:
            (sweep_dir / name).unlink(missing_ok=True)
    here, folder = Path.cwd().resolve(), sweep_dir.resolve()
    while folder != here and here in folder.parents:  # up to the working directory (runs/multirun/...)
        try:
            folder.rmdir()
        except OSError:
            break
        folder = folder.parent


def _save_logging():
    """Hydra configures Python logging for its run (--info turns it to DEBUG); undo that afterwards, so that a
    caller in the same process (tests, notebooks) keeps its own logging."""
    import logging

    names = [None] + [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "hydra"]
    # Hydra writes --info, --cfg and the sweep lines through logging. A reader that closed the pipe
    # (`dsaflow train --info | head`) would make every later record print a "Logging error" traceback: drop them.
    logging.raiseExceptions = False
    return [
        (
            logging.getLogger(n),
            logging.getLogger(n).level,
            list(logging.getLogger(n).handlers),
            logging.getLogger(n).propagate,
            logging.getLogger(n).disabled,
        )
        for n in names
    ]


def _restore_logging(saved) -> None:
    import logging

    logging.raiseExceptions = True
    for lg, level, handlers, propagate, disabled in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
    for name in logging.root.manager.loggerDict:  # loggers Hydra created during the run
        if name.split(".")[0] == "hydra" and all(name != (s[0].name) for s in saved):
            lg = logging.getLogger(name)
            lg.setLevel(logging.NOTSET)
            lg.handlers[:] = []


def run_hydra_app(command: str, rest: List[str], nproc: Optional[int], fmt: str, task: Callable = job_task) -> int:
    """Hand `rest` (Hydra flags + overrides) to Hydra's app runner with `task` as the task function.
    -> exit status: 0, 2 for a config mistake found before any job started, else 1 if any job failed."""
    global _STATE
    from hydra.core.global_hydra import GlobalHydra

    from dsaflow.config.compose import check_group_overrides, default_config_dir, quote_layout_overrides
    from dsaflow.config.hydra_private import hydra_args_parser, hydra_run_app
    from dsaflow.config.schema import register_configs
    from dsaflow.launch.interrupts import name_of, status_of, stop_signals_raise
    from dsaflow.launch.sweep_guard import hold_sweep_dir, not_run, one_job_at_a_time

    parser = hydra_args_parser()
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # argparse already printed the usage line
        return int(exc.code or 0)
    check_group_overrides(list(args.overrides), default_config_dir())
    args.overrides = quote_layout_overrides(list(args.overrides))
    planned: List[List[str]] = []
    if args.multirun:
        _refuse_in_multirun(args.overrides)
        check_sweeper_plugin(args.overrides)
        sweeper = any(o.lstrip("+~").split("=", 1)[0] in ("hydra/sweeper",) for o in args.overrides)
        planned = [] if sweeper else preflight_basic_sweep(args.overrides)
        args.overrides = one_job_at_a_time(args.overrides)
        if not any(o.startswith("hydra.job.name=") for o in args.overrides):
            args.overrides.append(f"hydra.job.name=dsaflow-{command}")
    _STATE = SweepState(command, nproc, fmt, planned=planned)
    register_configs()
    GlobalHydra.instance().clear()
    code = 0
    saved_logging = _save_logging()
    try:
        with hold_sweep_dir(args.overrides if args.multirun else []), stop_signals_raise():
            hydra_run_app(args, parser, task, str(default_config_dir().resolve()))
    except SystemExit as exc:  # Hydra's run_and_report printed the error already
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt as exc:  # SIGINT, SIGTERM or SIGHUP: the running job stopped, no further job starts
        code = status_of(exc)
        _STATE.results += not_run(_STATE.planned, len(_STATE.results), JobResult)
        print(f"dsaflow {command}: interrupted ({name_of(exc)}); no further job started", file=sys.stderr, flush=True)
    finally:
        GlobalHydra.instance().clear()
        _restore_logging(saved_logging)
    state, _STATE = _STATE, None
    if args.multirun and state.sweep_dir and command == "plan":
        _remove_empty_sweep_dir(Path(state.sweep_dir), state.results)
        ok = sum(r.exit_code == 0 for r in state.results)
        print(f"planned {ok}/{len(state.results)} jobs (plan -m writes nothing)", flush=True)
    elif args.multirun and state.sweep_dir:
        from dsaflow.track.sweep_summary import write_summary

        print(write_summary(state.sweep_dir, state.results, state.wandb_group), flush=True)
        if any(r.exit_code != 0 for r in state.results):
            code = code or 1
    return code
