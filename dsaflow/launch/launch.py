"""`launch(cfg, plan, job)`: check, write the run dir, start one process per pipeline rank, supervise the tree.

The parent (the `dsaflow` CLI) has composed the config (ranges and choices are checked by the schema) and planned
it; this module never imports Hydra. Everything that can be checked before a process starts is checked here
(`check_launch`: devices, data, serving, the run dir and any resume, wandb login, memory) and raises `PlanError`, so
a bad launch stops with a one-paragraph message and leaves nothing on disk.

The command it runs (torchrun in-process, under dsaflow's process rules: dsaflow.launch.agent):

    python -m dsaflow.launch.agent --standalone --nproc-per-node N -m dsaflow.worker RUN_DIR --job train

(`python -m torch.distributed.run` with the same arguments works by hand on an existing run dir.)
One process tree: the agent runs in its own session, so a Ctrl-C at the terminal reaches only the parent, which
then stops the agent and every worker (SIGKILL to the tree; each child also dies with its parent) and prints one
line; the exit status is 128 + the signal. NCCL on GPUs (one process per GPU), gloo on CPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from dsaflow.checkpoint.resume import check_resume
from dsaflow.checkpoint.store import report_stderr
from dsaflow.errors import EXIT_USER_ERROR, PlanError
from dsaflow.files import UnsafeFile, read_text
from dsaflow.outputs import check_output_file
from dsaflow.pipeline.devices import resolve_device_type
from dsaflow.plan.plan import Plan
from dsaflow.rundir.folder import LOG, TMP, check_run_dir, write_run_dir
from dsaflow.rundir.lock import LOCK_ENV, run_dir_lock

from .interrupts import STOP_SIGNALS, Interrupted, name_of, raise_interrupted, status_of, stopping

# Kept on the GPU machines (NVLink multicast off); a user's own values win.
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
STOP_TIMEOUT_S = 10.0
WATCH_EVERY_S = 1.0


def check_track(cfg) -> None:
    """track.mode=online needs a wandb login: say how, before anything starts (no wandb import)."""
    t = cfg.track
    if str(t.backend) != "wandb" or str(t.mode) != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        import netrc

        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise PlanError(
        f"track=online streams to wandb, but no login for {host} was found (no WANDB_API_KEY, no ~/.netrc entry). "
        "Fix: run `wandb login` (or export WANDB_API_KEY=...), or use track=offline (sync later with `wandb sync "
        "<run_dir>/wandb/offline-run-*`) or track=none."
    )


def check_launch(cfg, plan: Plan, job: str = "train", local: bool = True) -> None:
    """Everything a worker would otherwise trip over, checked in the parent. Raises PlanError.
    local=False (a run dir prepared for other nodes): skip the checks about this machine's GPUs and memory."""
    ranks = plan.pipeline.world_size  # pipeline ranks x parallel.dp processes
    device = resolve_device_type(cfg.train.device)
    if device == "cuda" and local:
        import torch

        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpu == 0:
            raise PlanError("train.device=cuda but no CUDA GPU is visible. Fix: train.device=auto (or cpu).")
        if ranks > n_gpu:
            raise PlanError(
                f"the plan has {ranks} ranks ({plan.pipeline.ranks} pipeline ranks x parallel.dp="
                f"{plan.pipeline.dp}) but this node has {n_gpu} GPUs (one process per GPU). Fix: use fewer ranks "
                f"(pipeline.ranks x parallel.dp <= {n_gpu}), or prepare the run dir with "
                "`python -m dsaflow.launch.launch prepare ...` and start it on several nodes with launch/multi_node.sh."
            )
    from .resources import check_resources

    check_resources(cfg, plan, device, job, local)  # before anything allocates (a huge batch would hang here)
    if job == "generate":  # serve config, prompts and graph blocks (dsaflow.serve.generate; raises ServeError)
        from dsaflow.serve.generate import check_serve

        s = cfg.serve  # never onto a run, a checkpoint or this command's own inputs (dsaflow.outputs)
        inputs = {"serve.prompts_file": s.prompts_file, "serve.checkpoint": s.checkpoint, "run_dir": cfg.run_dir}
        check_output_file("serve.output_file", s.output_file, inputs)
        check_serve(cfg, plan, device)
    else:
        t = cfg.train
        if t.seq_len > cfg.model.max_seq_len:
            raise PlanError(
                f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}. Fix: lower "
                "train.seq_len or raise model.max_seq_len."
            )
        if t.init_from:
            check_init_from(cfg)
        if cfg.model.hf_path and not t.resume:  # the headers against the plan's stages (resume: the run's weights)
            from dsaflow.pipeline.stages import check_hf_checkpoint

            check_hf_checkpoint(cfg, plan)
        if t.stop_at_step is not None and t.stop_at_step > t.steps:
            raise PlanError(
                f"train.stop_at_step={t.stop_at_step}: must lie in 1..train.steps={t.steps}. Fix: adjust it or drop it."
            )
        from dsaflow.checkpoint.hf_folder import tokenizer_json
        from dsaflow.checkpoint.hf_run_copy import hf_files_folder
        from dsaflow.data import BatchSource
        from dsaflow.data.hf_tokenizer import checkpoint_tokenizer

        hf_files = hf_files_folder(cfg.model.hf_path, cfg.run_dir if t.resume else None)
        tok = checkpoint_tokenizer(tokenizer_json(hf_files))
        BatchSource(cfg.data, t.seq_len, min(t.batch_size, 2), t.seed, cfg.model.vocab_size, tok).check_first_batch()
        check_track(cfg)
    check_run_dir(cfg, plan, job)
    if job == "train" and cfg.train.resume:
        check_resume(cfg, plan, report_stderr)


def check_init_from(cfg) -> None:
    """train.init_from: not with resume, an existing good checkpoint of the same model (weights are read later)."""
    t = cfg.train
    if t.resume:
        raise PlanError(
            f"train.init_from={t.init_from} with train.resume=true: resume continues run_dir from its own checkpoint, "
            "init_from starts a new run from another run's weights. Fix: drop one of the two."
        )
    if not os.path.exists(t.init_from):
        raise PlanError(f"train.init_from={t.init_from} does not exist. Fix: a run dir or a checkpoint folder.")
    from dsaflow.checkpoint.weights import WEIGHTLESS_MODEL_FIELDS, check_same_model, resolve_checkpoint

    field = "train.init_from"
    check_same_model(cfg.model, resolve_checkpoint(t.init_from, field=field), field, WEIGHTLESS_MODEL_FIELDS)


def torchrun_command(run_dir: str | Path, nproc: int, job: str = "train") -> List[str]:
    return [
        sys.executable,
        "-m",
        "dsaflow.launch.agent",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dsaflow.worker",
        str(run_dir),
        "--job",
        job,
    ]


def launch_env(base: Optional[Dict[str, str]] = None, run_dir: Optional[Path] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k, v in GPU_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several processes, without its banner
    if run_dir is not None:  # every file of the launch inside the run dir (torchelastic temp dirs, wandb caches)
        tmp = Path(run_dir).resolve() / TMP
        env["TMPDIR"] = str(tmp)
        env.setdefault("WANDB_CACHE_DIR", str(tmp / "wandb-cache"))
        env.setdefault("WANDB_DATA_DIR", str(tmp / "wandb-data"))
        env["DSAFLOW_PARENT"] = str(os.getpid())
    return env


def interrupt_hint(run_dir: Path, job: str) -> str:
    """What an interrupted run can do next: resume only where a checkpoint was saved (resume refuses otherwise)."""
    from dsaflow.rundir.folder import list_checkpoints

    if job != "train":
        return ""
    saved = list_checkpoints(run_dir)
    if saved:
        return f" (step {saved[0][0]} was saved; continue with train.resume=true run_dir={run_dir})"
    return (  # whatever train.ckpt_every was: the run stopped before its first save
        " (it stopped before its first checkpoint, so it cannot resume: train.ckpt_every=N saves every N steps, 0 "
        "only at the end. Start again, with a smaller train.ckpt_every for an earlier first save)"
    )


def interrupted_message(job: str, signum: int, stopped: int, run_dir: Path, tty: bool) -> str:
    """The one line an interrupt prints. On a terminal the progress bar's line is still open (the workers run in
    their own session and never see the Ctrl-C), so the message starts on a line of its own."""
    return (
        f"{chr(10) if tty else ''}dsaflow {job}: interrupted ({signal.Signals(signum).name}); stopped torchrun and "
        f"its workers ({stopped} processes). Run dir: {run_dir}{interrupt_hint(run_dir, job)}"
    )


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _rank_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return f"rank {env[b'RANK'].decode()}" if b"RANK" in env else "torchrun"
    except (OSError, KeyError, ValueError):
        return "a process"


class Watchdog:
    """The parent's eye on the tree: a stopped process (SIGSTOP, a debugger) makes every peer wait in silence, so
    say within seconds which one it is and what the others wait for, and give up after `timeout_s`."""

    def __init__(self, root: int, job: str, timeout_s: float, say=None):
        self.root, self.job, self.timeout_s = root, job, timeout_s
        self.stopped_since: Dict[int, float] = {}
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def check(self, now: float) -> Optional[str]:
        """Returns a reason to give up, or None."""
        from .lifecycle import descendants

        stopped = {p for p in [self.root, *descendants(self.root)] if _proc_state(p) in ("T", "t")}
        for p in list(self.stopped_since):
            if p not in stopped:
                del self.stopped_since[p]
                self.say(f"dsaflow {self.job}: pid {p} continues")
        for p in stopped:
            if p not in self.stopped_since:
                self.stopped_since[p] = now
                self.say(
                    f"dsaflow {self.job}: {_rank_of(p)} (pid {p}) is stopped (SIGSTOP or a debugger); the other "
                    f"ranks wait for it in their next send, receive or collective. Giving up in "
                    f"launch.timeout_s={self.timeout_s:g} s unless it continues (kill -CONT {p})."
                )
            elif now - self.stopped_since[p] > self.timeout_s:
                return (
                    f"{_rank_of(p)} (pid {p}) stayed stopped for more than launch.timeout_s={self.timeout_s:g} s; "
                    "stopped every process of the run"
                )
        return None


def supervise(cmd: List[str], env: Dict[str, str], run_dir: Path, job: str, timeout_s: float = 600.0) -> int:
    """Run the agent in its own session and wait; SIGINT/SIGTERM stop the whole tree (one line, 128 + signal); a
    process stopped for longer than `timeout_s` stops it too (status 1)."""
    from .lifecycle import die_with_parent, kill_tree

    main_thread = threading.current_thread() is threading.main_thread()
    old = {}
    if main_thread:
        for s in STOP_SIGNALS:
            old[s] = signal.signal(s, raise_interrupted)
    proc = None
    (run_dir / TMP).mkdir(exist_ok=True)  # TMPDIR must exist, or tempfile falls back to /tmp
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
        dog = Watchdog(proc.pid, job, timeout_s)
        while True:
            try:
                rc = proc.wait(timeout=WATCH_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                reason = dog.check(time.monotonic())
                if reason:
                    kill_tree(proc.pid)
                    proc.wait()
                    print(f"dsaflow {job}: {reason}. Run dir: {run_dir}", file=sys.stderr, flush=True)
                    return 1
    except Interrupted as exc:  # SIGINT, SIGTERM or SIGHUP, raised once (dsaflow.launch.interrupts)
        n = kill_tree(proc.pid) if proc is not None else 0
        if proc is not None:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        print(interrupted_message(job, exc.signum, n, run_dir, sys.stderr.isatty()), file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        for s, h in old.items():
            if not stopping():  # after a stop they stay ignored: one line, one status
                signal.signal(s, h)
        if proc is not None and proc.poll() is None:
            kill_tree(proc.pid)
        shutil.rmtree(run_dir / TMP, ignore_errors=True)
    if rc == EXIT_USER_ERROR:
        errors = sorted(run_dir.glob("error-rank*.txt"))
        if errors:
            try:
                text = read_text(errors[0], inside=run_dir, max_bytes=1 << 16).strip()
            except UnsafeFile as exc:
                text = f"a worker reported a user error, but {exc}"
            print(f"dsaflow {job}: error: {text}", file=sys.stderr, flush=True)
    elif rc != 0:
        print(
            f"dsaflow {job}: workers exited with status {rc}; see the output above and {worker_logs(run_dir, job)}",
            file=sys.stderr,
            flush=True,
        )
    return rc


def worker_logs(run_dir: Path, job: str) -> str:
    """The log files a failed job's workers left in run_dir, for its message: train.log for training (the
    logging rank's), serve_rank<r>.log for generate (one per rank, dsaflow.serve.generate)."""
    if job == "train":
        return str(run_dir / LOG)
    logs = sorted(run_dir.glob("serve_rank*.log"), key=lambda p: (len(p.name), p.name))
    if not logs:
        return f"{run_dir}/serve_rank<r>.log (none was written: the workers stopped before serving)"
    return ", ".join(str(p) for p in logs[:4]) + (f" and {len(logs) - 4} more" if len(logs) > 4 else "")


def launch(cfg, plan: Plan, job: str = "train") -> int:
    """Check, write the run dir, run the workers under the run dir's lock; returns the exit status (0 = every rank
    finished, 2 = a user error, 128 + signal = interrupted)."""
    try:
        check_launch(cfg, plan, job)  # may scan a large corpus: Ctrl-C here is one line, not a traceback
    except KeyboardInterrupt as exc:
        print(
            f"dsaflow {job}: interrupted during the pre-launch checks ({name_of(exc)}); nothing was started or "
            "written.",
            file=sys.stderr,
            flush=True,
        )
        return status_of(exc)
    from dsaflow.plan import render_table

    resume = job == "train" and cfg.train.resume
    if resume:  # the run dir exists: lock it before rewriting its files
        with run_dir_lock(cfg.run_dir, job, report_stderr):
            return _launch_in(cfg, plan, job, write_run_dir(cfg, plan, render_table(plan, cfg), job))
    run_dir = write_run_dir(cfg, plan, render_table(plan, cfg), job, kept_files(cfg, job))  # new and unique
    with run_dir_lock(run_dir, job, report_stderr):
        return _launch_in(cfg, plan, job, run_dir)


def _launch_in(cfg, plan: Plan, job: str, run_dir: Path) -> int:
    for stale in run_dir.glob("error-rank*.txt"):
        stale.unlink()  # unlink removes a link itself, never its target
    cmd = torchrun_command(run_dir, plan.pipeline.world_size, job)
    from .input_watch import changed_inputs, snapshot
    from .pipes import survive_closed_stdout
    from .run_summary import shell_command, train_summary

    survive_closed_stdout()  # `dsaflow train | head`: the run goes on when the reader leaves

    print(f"run dir: {run_dir}\nlaunch:  {shell_command(cmd)}", flush=True)
    env = launch_env(run_dir=run_dir)
    env[LOCK_ENV] = str(run_dir.resolve())  # the workers are under this launch's lock
    inputs = snapshot(cfg, job)
    rc = supervise(cmd, env, run_dir, job, cfg.launch.timeout_s)
    for line in changed_inputs(inputs) if rc < 128 else []:  # a SIGBUS names no file: name it
        print(f"dsaflow {job}: {line}", file=sys.stderr, flush=True)
    if job == "train" and rc < 128:  # an interrupted run already said so in one line
        print(train_summary(cfg, run_dir, rc), flush=True)
    return rc


def prepare(cfg, plan: Plan, job: str = "train") -> Path:
    """Check and write the run dir without starting anything (multi-node: every node's torchrun reads it)."""
    check_launch(cfg, plan, job, local=False)
    from dsaflow.plan import render_table

    return write_run_dir(cfg, plan, render_table(plan, cfg), job, kept_files(cfg, job))


def kept_files(cfg, job: str) -> Dict[str, bytes]:
    """What a new training run keeps of its inputs: the Hugging Face files of model.hf_path (config.json, the
    tokenizer), so that resume, generate and export work after that folder is gone (dsaflow.checkpoint.hf_run_copy)."""
    if job != "train" or not cfg.model.hf_path or cfg.train.resume:
        return {}
    from dsaflow.checkpoint.hf_run_copy import run_copy_files

    return run_copy_files(cfg.model.hf_path)


def main(argv=None) -> int:
    """`python -m dsaflow.launch.launch prepare [overrides]`: compose + plan + write the run dir, print its path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "prepare":
        print("usage: python -m dsaflow.launch.launch prepare [hydra overrides]", file=sys.stderr)
        return 2
    from dsaflow.config.compose import compose
    from dsaflow.config.from_run import settings_from_run
    from dsaflow.plan import build_plan

    try:
        from dsaflow.checkpoint.hf_config import apply_hf_model

        cfg = compose(args[1:], model_source=apply_hf_model)
        cfg = settings_from_run(cfg, args[1:], "train")  # a resume keeps the run's settings
        print(prepare(cfg, build_plan(cfg)))
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
