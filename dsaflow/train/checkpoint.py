"""Checkpoints with torch.distributed.checkpoint (DCP): every rank saves its own stages, collectively.

State of a rank (flat keys, so DCP never mistakes two ranks' tensors for replicas of one another):
    model.<global param/buffer name>      StageModule keys are global (`layers.5.attn.wkv_b.weight`)
    optim.main.<name>.{exp_avg,exp_avg_sq,step}, optim.indexer.<name>.{...}
    rng.rank<r>.cpu / rng.rank<r>.cuda   RNG streams of this rank
    step                                  replicated: completed steps (the data position: batches are indexed by step)
The lr schedule is a pure function of the step, so the step restores it too. A folder is complete once DCP has
written its `.metadata`; `latest_checkpoint` ignores the others.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from .optim import RankOptim

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _optim_state(opt: torch.optim.Optimizer, params: Sequence[nn.Parameter], names, prefix: str, fill: bool):
    """{prefix.<name>.<key>: tensor}; with fill=True missing state is created as zeros (a load template)."""
    out: Dict[str, torch.Tensor] = {}
    for p in params:
        st = opt.state.get(p)
        if not st:
            if not fill:
                continue
            st = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                  "step": torch.zeros((), dtype=torch.float32)}
            opt.state[p] = st
        for k in ADAM_KEYS:
            out[f"{prefix}.{names[p]}.{k}"] = st[k]
    return out


def rank_state(modules: Sequence[nn.Module], opt: RankOptim, rank: int, step: int, for_load: bool) -> Dict[str, object]:
    sd: Dict[str, object] = {"step": torch.tensor(step, dtype=torch.int64)}
    for m in modules:
        for k, v in m.state_dict().items():
            sd[f"model.{k}"] = v
    sd.update(_optim_state(opt.main, opt.main_params, opt.names, "optim.main", for_load))
    sd.update(_optim_state(opt.indexer, opt.indexer_params, opt.names, "optim.indexer", for_load))
    sd[f"rng.rank{rank}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return sd


def save_checkpoint(path: Path, modules, opt: RankOptim, rank: int, step: int, group=None) -> None:
    """Collective: every rank of the pipeline calls it with its own stages."""
    dcp.save(rank_state(modules, opt, rank, step, for_load=False), checkpoint_id=str(path), process_group=group)


def load_checkpoint(path: Path, modules, opt: RankOptim, rank: int, group=None) -> int:
    """Collective. Loads model + optimiser + RNG in place; returns the completed step to continue from."""
    sd = rank_state(modules, opt, rank, 0, for_load=True)
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    # model.* entries are the modules' own tensors: loaded in place. Optimiser state tensors were installed in
    # opt.state by the template, also loaded in place. RNG needs an explicit set.
    torch.set_rng_state(sd[f"rng.rank{rank}.cpu"])
    if f"rng.rank{rank}.cuda" in sd:
        torch.cuda.set_rng_state(sd[f"rng.rank{rank}.cuda"])
    return int(sd["step"])
