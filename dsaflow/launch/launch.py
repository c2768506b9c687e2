"""`launch(cfg, plan, job)`: check, write the run dir, start one process per pipeline rank with torchrun.

The parent (the `dsaflow` CLI) has composed the config with Hydra and planned it; this module never imports Hydra.
Everything that can be checked before a process starts is checked here (`check_launch`) and raises `PlanError`, so
a bad launch config stops with a one-paragraph message and leaves nothing on disk.

The command it runs (also what a user can run by hand on an existing run dir):

    python -m torch.distributed.run --standalone --nproc-per-node N -m dsaflow.worker RUN_DIR --job train

NCCL on GPUs (one process per GPU, `torch.cuda.set_device(local_rank)`), gloo on CPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from dsaflow.plan.plan import Plan, PlanError

from dsaflow.run.context import resolve_device_type
from dsaflow.run.rundir import latest_checkpoint, write_run_dir

# Kept on the GPU machines (NVLink multicast off); a user's own values win.
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

_CHOICES = {
    "train.dsa_stage": ("dense_warmup", "sparse"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.progress": ("auto", "rich", "lines", "off"),
    "data.kind": ("retrieval", "text", "bin"),
    "data.loss_on": ("answer", "all"),
    "track.backend": ("wandb", "none"),
    "track.mode": ("offline", "online", "disabled"),
}


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_launch(cfg, plan: Plan, job: str = "train", local: bool = True) -> None:
    """Everything a worker would otherwise trip over, checked in the parent. Raises PlanError.
    local=False (a run dir prepared for other nodes): skip the checks about this machine's GPUs."""
    for field, allowed in _CHOICES.items():
        v = _get(cfg, field)
        if v not in allowed:
            raise PlanError(f"{field}={v!r} is not a valid choice. Fix: use one of {', '.join(allowed)}.")
    ranks = plan.pipeline.ranks
    device = resolve_device_type(cfg.train.device)
    if device == "cuda" and local:
        import torch

        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpu == 0:
            raise PlanError("train.device=cuda but no CUDA GPU is visible. Fix: train.device=auto (or cpu).")
        if ranks > n_gpu:
            raise PlanError(
                f"the plan has {ranks} pipeline ranks but this node has {n_gpu} GPUs (one process per GPU). Fix: "
                f"use pipeline.ranks<={n_gpu} (e.g. pipeline.stages={n_gpu}), or prepare the run dir with "
                "`python -m dsaflow.launch.launch prepare ...` and start it on several nodes with launch/multi_node.sh."
            )
    if job == "generate":  # serve config, prompts and graph blocks (dsaflow.serve.generate; raises ServeError)
        from dsaflow.serve.generate import check_serve

        check_serve(cfg, plan, device)
    if job != "train":
        return
    t = cfg.train
    positive = {"train.steps": t.steps, "train.seq_len": t.seq_len, "train.batch_size": t.batch_size,
                "train.log_every": t.log_every, "train.eval_batches": t.eval_batches, "train.cpu_threads": t.cpu_threads}
    for name, v in positive.items():
        if v < 1:
            raise PlanError(f"{name}={v}: must be >= 1. Fix: set {name} to a positive value.")
    for name, v in {"train.eval_every": t.eval_every, "train.ckpt_every": t.ckpt_every,
                    "train.dense_warmup_steps": t.dense_warmup_steps, "train.warmup_steps": t.warmup_steps}.items():
        if v < 0:
            raise PlanError(f"{name}={v}: must be >= 0 (0 = off). Fix: set {name}>=0.")
    if t.seq_len > cfg.model.max_seq_len:
        raise PlanError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}. Fix: lower train.seq_len "
            f"or raise model.max_seq_len."
        )
    if len(t.betas) != 2:
        raise PlanError(f"train.betas={list(t.betas)}: AdamW needs two betas. Fix: e.g. train.betas=[0.9,0.95].")
    if t.stop_at_step is not None and not (1 <= t.stop_at_step <= t.steps):
        raise PlanError(f"train.stop_at_step={t.stop_at_step}: must lie in 1..train.steps={t.steps}. Fix: adjust it or drop it.")
    from dsaflow.data import BatchSource

    try:
        BatchSource(cfg.data, t.seq_len, t.batch_size, t.seed, cfg.model.vocab_size).batch(0)
    except ValueError as e:  # CorpusError and retrieval spec errors name their fields already
        raise PlanError(str(e)) from None
    if t.resume:
        if not cfg.run_dir:
            raise PlanError("train.resume=true needs run_dir=<the run to continue>. Fix: add run_dir=runs/<name>.")
        if latest_checkpoint(cfg.run_dir) is None:
            raise PlanError(
                f"train.resume=true but run_dir={cfg.run_dir} holds no complete checkpoint. Fix: point run_dir at a "
                "run that saved one (train.ckpt_every>0), or drop train.resume."
            )


def torchrun_command(run_dir: str | Path, nproc: int, job: str = "train") -> List[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "dsaflow.worker", str(run_dir), "--job", job,
    ]


def launch_env(base: Dict[str, str] | None = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k, v in GPU_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    # torchrun sets OMP_NUM_THREADS=1 on multi-process runs anyway, with a warning banner; say it ourselves
    # (workers set their torch threads from train.cpu_threads).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(cfg, plan: Plan, job: str = "train") -> int:
    """Check, write the run dir, run torchrun; returns the launcher's exit status (0 = every rank finished)."""
    check_launch(cfg, plan, job)
    from dsaflow.plan import render_table

    run_dir = write_run_dir(cfg, plan, render_table(plan, cfg))
    cmd = torchrun_command(run_dir, plan.pipeline.ranks, job)
    from .run_summary import shell_command, train_summary

    print(f"run dir: {run_dir}\nlaunch:  {shell_command(cmd)}", flush=True)
    rc = subprocess.call(cmd, env=launch_env())
    if rc != 0:
        print(f"dsaflow {job}: workers exited with status {rc}; see the output above and {run_dir}/train.log",
              file=sys.stderr, flush=True)
    if job == "train":
        print(train_summary(cfg, run_dir, rc), flush=True)
    return rc


def prepare(cfg, plan: Plan, job: str = "train") -> Path:
    """Check and write the run dir without starting anything (multi-node: every node's torchrun reads it)."""
    check_launch(cfg, plan, job, local=False)
    from dsaflow.plan import render_table

    return write_run_dir(cfg, plan, render_table(plan, cfg))


def main(argv=None) -> int:
    """`python -m dsaflow.launch.launch prepare [overrides]`: compose + plan + write the run dir, print its path."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "prepare":
        print("usage: python -m dsaflow.launch.launch prepare [hydra overrides]", file=sys.stderr)
        return 2
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan

    try:
        cfg = compose(args[1:])
        print(prepare(cfg, build_plan(cfg)))
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
