"""Multi-process gloo harness for the training tests: run several training configs in one start of `world` CPU
processes (sequentially, sharing the process group), and collect per-step losses and final gradients.

The processes are forked from a forkserver that has imported torch and dsaflow's trainer once (per pytest process):
a fresh interpreter spends seconds importing them, once per rank and per start. Each rank still is its own process
with its own gloo process group, and takes the test process's environment at the time of the start, as a spawned
one would."""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsaflow.config.schema import DSAFlowConfig
from dsaflow.plan import build_plan

# A CPU run small enough to start in seconds (the launch, fault, signal and non-finite tests), and its two-rank form
TINY_RUN = [
    "track=none",
    "model.num_layers=2",
    "model.dim=32",
    "model.inter_dim=64",
    "model.index_topk=8",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=lines",
]
TINY_PP2_RUN = ["pipeline=pp2", "train.log_every=1", *TINY_RUN]


def tiny_cfg(stages: int = 1, ranks=None, schedule: str = "1F1B", steps: int = 3, **train) -> DSAFlowConfig:
    """8 layers "FS" x 4 of width 32: every stage split used by the tests keeps the PP=1 roles (no promotion)."""
    cfg = DSAFlowConfig()
    m = cfg.model
    m.num_layers, m.dim, m.inter_dim, m.index_topk = 8, 32, 64, 8
    cfg.index.pattern = "FS"
    cfg.pipeline.stages, cfg.pipeline.ranks, cfg.pipeline.schedule = stages, ranks, schedule
    cfg.pipeline.balance, cfg.pipeline.microbatches = "layers", 4
    t = cfg.train
    t.steps, t.seq_len, t.batch_size, t.warmup_steps, t.eval_every, t.eval_batches = steps, 32, 8, 1, 0, 1
    t.progress, cfg.track.backend = "off", "none"
    cfg.data.num_pairs, cfg.data.num_queries = 4, 4  # 4 answers per sequence: more loss positions to compare
    for k, v in train.items():
        setattr(t, k, v)
    return cfg


def stop_and_resume_cfgs(root: Path, stages: int, ranks: int, schedule: str, stop_at: int, **train):
    """(uninterrupted, stopped after `stop_at`, resumed) configs of one tiny run: the last two share a run dir."""
    full = tiny_cfg(stages, ranks, schedule, **train)
    full.run_dir = str(root / "full")
    stopped = tiny_cfg(stages, ranks, schedule, stop_at_step=stop_at, **train)
    stopped.run_dir = str(root / "killed")
    resumed = tiny_cfg(stages, ranks, schedule, resume=True, **train)
    resumed.run_dir = stopped.run_dir
    return full, stopped, resumed


def free_port() -> int:
    """A free TCP port for a rendezvous, below the kernel's ephemeral range (32768 and up on Linux): a port the OS
    hands out (bind to 0) can be taken, before the store binds it, by an outgoing connection of another test's gloo
    ranks running beside this one (pytest-xdist). Each xdist worker searches its own block of 1000 ports."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base = 20000 + 1000 * (int(worker[2:]) % 12 if worker[2:].isdigit() else 0)
    start = random.randrange(1000)
    for i in range(1000):
        port = base + (start + i) % 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{base}, {base + 1000})")


# what every rank imports, imported once in the forkserver the ranks are forked from (a module that fails to import
# there is skipped: the rank then imports it itself)
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "dsaflow.plan",
    "dsaflow.pipeline.run_context",
    "dsaflow.train.trainer",
]

GRAD_STEPS = (0, 1)  # the gradients of these steps are captured (step 0 is dense_warmup in the tests, 1 sparse)


def _capture_grads(tr, out: dict, steps) -> None:
    """Wrap Trainer.step so that the (clipped) gradients of `steps` are copied into out[step][name] (whole tensors:
    gradients sharded over dp are gathered, which every replica's rank takes part in)."""
    from dsaflow.train.data_parallel import full_tensor

    inner = tr.step

    def step(i: int):
        metrics = inner(i)
        if i in steps:
            out[i] = {tr.opt.names[p]: full_tensor(p.grad).clone() for p in tr.opt.names if p.grad is not None}
        return metrics

    tr.step = step
    out["trainer"] = tr  # for the buffers after the run (popped before saving)


def _worker(rank: int, world: int, port: int, cfgs: List[DSAFlowConfig], out_dir: str, prepare, env: dict) -> None:
    os.environ.clear()  # the forkserver's environment is the one of its own start: take the test's, as spawn does
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from dsaflow.pipeline.run_context import RunContext, context_in_world
    from dsaflow.train.trainer import run_train

    try:
        for i, cfg in enumerate(cfgs):
            if prepare is not None:  # e.g. corrupt a checkpoint between two runs (rank 0, then everyone waits)
                if rank == 0:
                    prepare(i, cfg)
                dist.barrier()
            plan = build_plan(cfg)
            run_dir = Path(cfg.run_dir or Path(out_dir) / f"run{i}")
            run_dir.mkdir(parents=True, exist_ok=True)
            if cfg.parallel.dp * cfg.parallel.cp > 1:  # the ("dp", "pp") mesh, as the worker builds it
                ctx = context_in_world(cfg, plan, run_dir, torch.device("cpu"), rank)
            else:
                ctx = RunContext(cfg, plan, rank, world, rank, torch.device("cpu"), run_dir)
            grads: dict = {}
            history = run_train(ctx, on_trainer=lambda tr: _capture_grads(tr, grads, GRAD_STEPS))
            trainer = grads.pop("trainer")
            biases = {  # MoE routing biases (buffers: whole on every rank)
                k: v.clone() for m in trainer.modules for k, v in m.named_buffers() if "e_score_correction_bias" in k
            }
            torch.save(
                {
                    "history": history,
                    "grads": grads,
                    "logging": ctx.is_logging_rank,
                    "biases": biases,
                    "dp_rank": ctx.dp_rank,
                    "pp_rank": ctx.rank,
                },
                Path(out_dir) / f"cfg{i}_rank{rank}.pt",
            )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_configs(world: int, cfgs: List[DSAFlowConfig], out_dir: Path, prepare=None) -> List[dict]:
    """`prepare(i, cfg)` (picklable) runs on rank 0 before config i. -> per config: {"losses": [..], "history": [...],
    "grads": {step: {name: tensor}} (union over ranks), "ranks": [{"biases", "dp_rank", "pp_rank"} per rank]}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # no effect once this process's forkserver runs (it then has these imports already)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    args = (world, free_port(), cfgs, str(out_dir), prepare, dict(os.environ))
    mp.start_processes(_worker, args=args, nprocs=world, start_method="forkserver")
    results = []
    for i in range(len(cfgs)):
        merged = {"grads": {}, "ranks": []}
        for r in range(world):
            d = torch.load(out_dir / f"cfg{i}_rank{r}.pt", weights_only=False)
            merged["ranks"].append({k: d[k] for k in ("biases", "dp_rank", "pp_rank")})
            for step, g in d["grads"].items():
                merged["grads"].setdefault(step, {}).update(g)
            if d["logging"]:
                merged["history"] = d["history"]
                merged["losses"] = [h["loss"] for h in d["history"]]
        results.append(merged)
    return results
