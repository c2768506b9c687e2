"""Optimisers, the learning-rate schedule (torch's LambdaLR over `lr_factor`) and global gradient clipping for one
pipeline rank.

Two AdamW optimisers per rank: `main` (every non-indexer parameter; lr = train.lr) and `indexer` (the F layers'
indexer weights; lr = train.indexer_lr, no weight decay). dense_warmup steps only the indexer one (the main model is
frozen, DSA recipe); sparse steps both. Clipping uses the global norm over every rank of the pipeline (one
all-reduce of two numbers), so PP=N clips exactly like PP=1.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to `min_ratio` at `steps`. step is 0-based."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def is_indexer_param(name: str) -> bool:
    return ".attn.indexer." in name


@dataclass
class RankOptim:
    main: torch.optim.AdamW
    indexer: torch.optim.AdamW
    main_params: List[nn.Parameter]
    indexer_params: List[nn.Parameter]
    names: Dict[nn.Parameter, str]  # param -> global name (stage state-dict key), for checkpoints


def _fusable(params: Sequence[nn.Parameter]) -> bool:
    """CUDA parameters update in one fused kernel per group (torch's `fused=True`: one launch instead of several
    multi-tensor passes, same formula in fp32); CPU parameters take the default implementation."""
    return bool(params) and all(p.is_cuda for p in params)


def build_optimizers(stage_modules: Sequence[nn.Module], train_cfg) -> RankOptim:
    """stage_modules: this rank's StageModules (keys are global, so names never collide across stages)."""
    names: Dict[nn.Parameter, str] = {}
    main_decay, main_no_decay, idx = [], [], []
    for m in stage_modules:
        for n, p in m.named_parameters():
            if p in names:  # tied weights appear once
                continue
            names[p] = n
            if is_indexer_param(n):
                idx.append(p)
            elif p.dim() >= 2:
                main_decay.append(p)
            else:
                main_no_decay.append(p)
    betas = tuple(train_cfg.betas)
    groups = [
        g
        for g in (
            {"params": main_decay, "weight_decay": train_cfg.weight_decay},
            {"params": main_no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    dummy = [nn.Parameter(torch.zeros(1))]  # AdamW refuses an empty parameter list (a stage may have no indexer)
    main = torch.optim.AdamW(
        groups or [{"params": dummy}], lr=train_cfg.lr, betas=betas, fused=_fusable(main_decay + main_no_decay)
    )
    indexer = torch.optim.AdamW(
        idx or dummy, lr=train_cfg.indexer_lr, betas=betas, weight_decay=0.0, fused=_fusable(idx)
    )
    return RankOptim(main, indexer, main_decay + main_no_decay, idx, names)


def build_schedulers(opt: RankOptim, train_cfg, start_step: int = 0) -> List[torch.optim.lr_scheduler.LambdaLR]:
    """One LambdaLR per optimiser, lr = its configured lr * lr_factor(step), positioned so that the next update is
    step `start_step` (0, or the completed steps of a resumed run: the schedule is a function of the step alone)."""
    factor = functools.partial(
        lr_factor, steps=train_cfg.steps, warmup=train_cfg.warmup_steps, min_ratio=train_cfg.min_lr_ratio
    )
    scheds = []
    for o, base in ((opt.main, train_cfg.lr), (opt.indexer, train_cfg.indexer_lr)):
        for g in o.param_groups:
            g["initial_lr"] = base  # LambdaLR scales this; needed up front when it starts past step 0
        with warnings.catch_warnings():  # positioning at start_step is not a skipped optimizer step
            warnings.simplefilter("ignore", UserWarning)
            scheds.append(torch.optim.lr_scheduler.LambdaLR(o, factor, last_epoch=start_step - 1))
    return scheds


def advance(scheds: Sequence[torch.optim.lr_scheduler.LambdaLR]) -> None:
    """After a step's updates: the next step's lr. The schedule advances even when an update was skipped (dense
    warm-up steps only the indexer optimiser; a non-finite gradient skips one), so it stays a function of the step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()" in those cases
        for s in scheds:
            s.step()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this rank holds: its shard of a DTensor (parallel.dp_shard), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sq_norm(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    grads = [_local(p.grad.detach()).float() for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([(g * g).sum() for g in grads]).sum().to(device)


def clip_global(opt: RankOptim, max_norm: float, device: torch.device, group=None) -> Tuple[float, float]:
    """Global grad norms (main, indexer) over every pipeline rank; clips each set to max_norm (0 = no clip).
    Returns the pre-clip norms. group: the ranks whose squared norms add up to the model's: the pipeline (each
    rank its stages), or the world when gradients are sharded over dp (each rank its shards of its stages)."""
    sq = torch.stack([_sq_norm(opt.main_params, device), _sq_norm(opt.indexer_params, device)])
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norms = sq.sqrt()
    if max_norm > 0:
        for params, norm in ((opt.main_params, norms[0]), (opt.indexer_params, norms[1])):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                if p.grad is not None:
                    _local(p.grad).mul_(coef.to(p.grad.device))
    n = norms.tolist()
    return n[0], n[1]
