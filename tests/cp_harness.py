"""Context parallelism at the model level on gloo CPU ranks: each rank runs the whole sequence (the cp1 reference)
and its zigzag shard over the cp group, and reports both, so the test compares them."""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from train_harness import FORKSERVER_PRELOAD, free_port

from dsaflow.config.schema import ModelConfig
from dsaflow.model import IndexerLossInBackward, build_model
from dsaflow.model.context_parallel import GatheredKeys, zigzag_shard
from dsaflow.train.cp_comm import context_parallel

CFG = ModelConfig(num_layers=4, dim=32, inter_dim=64, index_topk=8, vocab_size=61, n_heads=2)
ROLES = "FSFS"
B, T = 2, 48


def _batch():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    y = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    y[0, :5] = -100  # ignored targets, unevenly spread over the shards
    return x, y


def _run(model, x, y, weight: float, kl_in_backward: bool, count_total: torch.Tensor, after_forward=lambda: None):
    """One forward + backward: LM loss as its sum over this shard / the global count of targets, indexer KL with
    `weight`; `after_forward()` runs between the two. Returns (lm loss part, indexer KL value, {name: grad})."""
    model.zero_grad(set_to_none=True)
    sink = IndexerLossInBackward(weight) if kl_in_backward else None
    kwargs = {"indexer_loss_in_backward": sink} if kl_in_backward else {"compute_indexer_loss": True}
    hidden = model(x, **kwargs)
    mean, _ = model.lm_loss(hidden, y, chunk_tokens=20)
    lm = mean * (y != -100).sum() / count_total
    loss = lm if kl_in_backward else lm + weight * model.indexer_loss
    kl = None if kl_in_backward else model.indexer_loss.detach()
    after_forward()
    loss.backward()
    if kl_in_backward:
        kl = sink.values[-1]
    return lm.detach(), kl, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def case(rank: int, world: int, recompute: str, kl_in_backward: bool) -> dict:
    """-> {"ref": (lm, kl, grads) of the whole sequence, "cp": the same summed (lm, grads) / averaged (kl) over the
    cp ranks, "regathers": how many times the backward gathered keys again}."""
    x, y = _batch()
    model = build_model(CFG, ROLES, seed=1)
    model.train()
    model.recompute, model.head_in_loss = recompute, True
    ref = _run(model, x, y, 1.0, kl_in_backward, (y != -100).sum())
    cp = context_parallel()
    model.cp = cp
    calls = {"n": 0}
    inner = cp.gather_values

    def counted(local):
        calls["n"] += 1
        return inner(local)

    cp.gather_values = counted
    xs, ys = zigzag_shard(x, world, rank), zigzag_shard(y, world, rank)
    storages, after = [], []  # weak references to every gathered storage; (gathers, alive) after the forward
    inner_gather = GatheredKeys.gather

    def gather(self, local):
        whole = inner_gather(self, local)
        storages.append(StorageWeakRef(whole.untyped_storage()))
        return whole

    def after_forward():
        gc.collect()
        after.append((calls["n"], sum(not s.expired() for s in storages)))

    GatheredKeys.gather = gather
    try:
        lm, kl, grads = _run(model, xs, ys, 1.0 / world, kl_in_backward, (y != -100).sum(), after_forward)
    finally:
        GatheredKeys.gather = inner_gather
    forward_gathers, alive = after[0]
    flat = torch.stack([lm, kl])
    dist.all_reduce(flat)
    for g in grads.values():
        dist.all_reduce(g)
    return {
        "ref": ref,
        "cp": (flat[0], flat[1] / world, grads),
        "gathers": (forward_gathers, calls["n"] - forward_gathers),
        "alive_after_forward": alive,
    }


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = [case(rank, world, *c) for c in cases]
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_cases(world: int, cases: list, out_dir: Path) -> list:
    """Every case [(recompute, kl_in_backward), ...] on `world` gloo ranks -> rank 0's results per case."""
    out_dir.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    args = (world, free_port(), cases, str(out_dir), dict(os.environ))
    mp.start_processes(_worker, args=args, nprocs=world, start_method="forkserver")
    return torch.load(out_dir / "rank0.pt", weights_only=False)
