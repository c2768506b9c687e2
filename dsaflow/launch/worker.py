"""The worker: read the run dir, join the process group, run the job. One process per pipeline rank."""
from __future__ import annotations

import os

import torch.distributed as dist

from dsaflow.errors import PlanError

from dsaflow.run.context import init_distributed
from dsaflow.run.lock import claim_run_dir
from dsaflow.run.rundir import read_run_dir

JOBS = ("train", "generate")


def run_worker(run_dir: str, job: str = "train") -> None:
    if job not in JOBS:
        raise PlanError(f"job={job!r} is not one of {JOBS}.")
    cfg, plan = read_run_dir(run_dir)
    with claim_run_dir(run_dir, cfg, job, int(os.environ.get("RANK", 0))):
        _run(cfg, plan, run_dir, job)


def _run(cfg, plan, run_dir: str, job: str) -> None:
    ctx = init_distributed(cfg, plan, run_dir)
    try:
        if job == "train":
            from dsaflow.train.loop import run_train

            run_train(ctx)
        else:
            from dsaflow.serve.generate import run_serve

            run_serve(ctx)
        # Tear down together: a rank that destroys its gloo group while a peer still finishes its last collective
        # (final checkpoint, tracker) can abort at exit ("terminate called without an active exception", seen once
        # under load in the end-to-end test). Only on success: after an error a peer may never reach the barrier.
        dist.barrier(group=ctx.group)
    finally:
        dist.destroy_process_group()
