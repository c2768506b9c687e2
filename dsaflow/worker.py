"""`python -m dsaflow.worker RUN_DIR [--job train|generate]`: the entry torchrun starts on every rank.

    python -m dsaflow.launch.agent --standalone --nproc-per-node 2 -m dsaflow.worker runs/20260101-120000-tiny-retrieval

The worker reads the run dir (config.yaml + plan.json, no Hydra), joins the process group and runs the job: one
process per pipeline rank. `dsaflow.launch.agent` takes torchrun's arguments; plain `torchrun` works too, and adds
its own failure report (a traceback) after the worker's message when a worker fails.

A user error found in a worker (the wrong number of processes, a bad or corrupt checkpoint, a data file the parent
could not fully check, a serving request) ends it with status 2 and one paragraph, written to
`<RUN_DIR>/error-rank<r>.txt` (the `dsaflow` parent prints it once) and, when run by hand, to stderr; never a
traceback. The worker dies with its parent (torchrun).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dsaflow.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, PlanError

ERROR_FILE = "error-rank{rank}.txt"
JOBS = ("train", "generate", "serve")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what the env:// rendezvous reads


def torchrun_problem(run_dir: str, job: str) -> str:
    """Why this process was not started by torchrun (one paragraph naming the missing variables), or ''."""
    missing = [v for v in TORCHRUN_ENV if not os.environ.get(v)]
    if not missing:
        return ""
    return (
        f"dsaflow {job}: error: {', '.join(missing)} not set: python -m dsaflow.worker is the entry torchrun starts on "
        "every rank, not a command to run by hand. Fix: run `dsaflow "
        f"{job}`, or start the workers under torchrun: python -m dsaflow.launch.agent --standalone "
        f"--nproc-per-node N -m dsaflow.worker {run_dir} --job {job} (N = the pipeline ranks x parallel.dp x parallel.cp of "
        f"{Path(run_dir) / 'plan.json'}; `torchrun` takes the same arguments)."
    )


def check_world_size(plan, run_dir: str) -> None:
    """The processes launched must be exactly the plan's pipeline ranks x parallel.dp (torchrun's WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    ranks = plan.pipeline.world_size
    if world != ranks:
        dp, cp = plan.pipeline.dp, plan.pipeline.cp
        what = (
            f"{plan.pipeline.ranks} pipeline ranks x parallel.dp={dp}"
            + (f" x parallel.cp={cp}" if cp > 1 else "")
            + f" = {ranks} ranks"
            if dp * cp > 1
            else (f"{ranks} pipeline rank{'s' if ranks != 1 else ''}")
        )
        raise PlanError(
            f"WORLD_SIZE={world}: {world} processes were launched, but {Path(run_dir) / 'plan.json'} has {what}. "
            f"Fix: launch exactly {ranks} process{'es' if ranks != 1 else ''} (nnodes x nproc-per-node = {ranks}), "
            f"e.g. --nproc-per-node {ranks} on one node."
        )


def check_node_size(plan) -> None:
    """With parallel.dp > 1, each node (torchrun's LOCAL_WORLD_SIZE processes, consecutive global ranks) must hold
    whole pipelines (nproc-per-node a multiple of the pipeline ranks: only the dp collectives cross nodes), or each
    pipeline whole nodes (pipeline ranks a multiple of nproc-per-node: a pp8 over two nodes of 4, as at dp=1).
    Anything else puts parts of two replicas' pipelines on one node, and a pipeline's every-tick transfers cross
    the network on some replicas only, so the slowest replica sets every step's pace."""
    ranks, local = plan.pipeline.ranks, int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if plan.pipeline.replicas == 1 or local <= 0 or local % ranks == 0 or ranks % local == 0:
        return
    raise PlanError(
        f"LOCAL_WORLD_SIZE={local}: {local} processes per node would split pipelines of {ranks} ranks across nodes "
        f"(global rank = dp index x {ranks} + pipeline rank; parallel.dp={plan.pipeline.dp}). Fix: --nproc-per-node "
        f"(NPROC_PER_NODE) a multiple of {ranks}, e.g. {ranks} with {plan.pipeline.world_size // ranks} nodes, or "
        f"a pipeline.ranks that is a multiple or a divisor of {local}."
    )


def run_worker(run_dir: str, job: str = "train") -> None:
    """Read the run dir, hold its lock (rank 0 without a dsaflow parent), join the process group (NCCL on GPUs,
    gloo on CPU), run `job` on this rank."""
    from dsaflow.rundir.folder import read_run_dir
    from dsaflow.rundir.lock import claim_run_dir

    if job not in JOBS:
        raise PlanError(f"job={job!r} is not one of {JOBS}. Fix: --job train, generate or serve.")
    cfg, plan = read_run_dir(run_dir)
    check_world_size(plan, run_dir)
    check_node_size(plan)
    with claim_run_dir(run_dir, cfg, job, int(os.environ.get("RANK", 0))):
        _run_job(cfg, plan, run_dir, job)


def _run_job(cfg, plan, run_dir: str, job: str) -> None:
    from dsaflow.pipeline.p2p import leave_together
    from dsaflow.pipeline.run_context import init_distributed

    ctx = init_distributed(cfg, plan, run_dir)
    # a peer may still finish its last collective (final checkpoint, tracker) when this rank is done
    with leave_together():  # the whole world: every replica's ranks
        if job == "train":
            from dsaflow.train.trainer import run_train

            run_train(ctx)
        elif job == "serve":
            from dsaflow.serve.online import run_online

            run_online(ctx)
        else:
            from dsaflow.serve.generate import run_serve

            run_serve(ctx)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsaflow.worker", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run dir written by `dsaflow train` (config.yaml + plan.json)")
    ap.add_argument("--job", default="train", choices=JOBS)
    args = ap.parse_args(argv)
    problem = torchrun_problem(args.run_dir, args.job)
    if problem:  # before anything touches the run dir: no lock, no error file
        print(problem, file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    from dsaflow.launch.lifecycle import die_with_parent
    from dsaflow.launch.pipes import survive_closed_stdout

    die_with_parent()
    survive_closed_stdout()  # a closed stdout (`dsaflow train | head`) must not look like a lost peer
    rank = os.environ.get("RANK", "0")
    try:
        run_worker(args.run_dir, args.job)
    except PlanError as exc:
        _report_user_error(args, rank, str(exc))
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - a lost peer is reported in one line; anything else is a bug
        if not _lost_peer(exc):
            raise
        print(
            f"dsaflow {args.job}: rank {rank} lost a peer ({str(exc).splitlines()[0][-160:]}); stopping",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def _report_user_error(args, rank: str, msg: str) -> None:
    by_hand = not os.environ.get("DSAFLOW_PARENT")  # else the dsaflow parent prints the first rank's file once
    # every rank found the same launch mistake: one paragraph is enough
    every_rank = msg.startswith(("WORLD_SIZE=", "LOCAL_WORLD_SIZE="))
    if by_hand and (rank == "0" or not every_rank):
        print(f"dsaflow {args.job}: error: [rank {rank}] {msg}", file=sys.stderr, flush=True)
    try:
        from dsaflow.files import atomic_write

        atomic_write(Path(args.run_dir) / ERROR_FILE.format(rank=rank), msg + "\n")  # never through a link
    except OSError:
        pass
    if by_hand and every_rank and rank != "0":
        # torchrun stops every other rank as soon as one exits: leave only after rank 0 has printed (its file is
        # written after its print), or it may be stopped before it says anything
        rank0 = Path(args.run_dir) / ERROR_FILE.format(rank=0)
        deadline = time.monotonic() + 10.0
        while not rank0.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _lost_peer(exc: BaseException) -> bool:
    """A collective or p2p failed because another rank died (gloo/NCCL report it as a RuntimeError)."""
    text = str(exc)
    return any(
        s in text
        for s in (
            "Connection reset by peer",
            "Connection closed by peer",
            "Broken pipe",
            "Socket Timeout",
            "NCCL communicator was aborted",
            "remote process exited",
            "Timed out waiting",
            "timed out after",
            "Timeout waiting",
            "Application timeout",
        )
    )


if __name__ == "__main__":
    from dsaflow.launch.lifecycle import exit_now

    try:
        main(sys.argv[1:])
    except SystemExit as done:  # the statuses main() chose; a bug's traceback still ends the usual way
        exit_now(0 if done.code is None else done.code if isinstance(done.code, int) else 1)
    exit_now(0)  # the job is done: skip the interpreter's teardown
