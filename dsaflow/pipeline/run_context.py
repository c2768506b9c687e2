"""What a worker process knows about itself: config, plan, rank, device, process group, run dir.

Built from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). Training and serving
(`dsaflow.serve.generate.run_serve(ctx)`) both receive this object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsaflow.pipeline.devices import resolve_device_type
from dsaflow.plan.plan import Plan


@dataclass
class RunContext:
    cfg: Any
    plan: Plan
    rank: int  # rank in `group` = pipeline rank
    world_size: int
    local_rank: int
    device: torch.device
    run_dir: Path
    group: Optional[dist.ProcessGroup] = None  # None = the default (world) group

    @property
    def stages(self):
        """StagePlans this rank runs (several for interleaved / V schedules)."""
        return self.plan.stages_of_rank(self.rank)

    @property
    def logging_rank(self) -> int:
        """The rank that logs: the one holding the last stage (it sees the loss)."""
        return self.plan.stages[-1].rank

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def init_distributed(cfg, plan: Plan, run_dir: Path) -> RunContext:
    """Initialise the default process group from torchrun's env: NCCL on GPUs (one per local rank), gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world != plan.pipeline.ranks:
        raise RuntimeError(
            f"WORLD_SIZE={world} but {run_dir}/plan.json has {plan.pipeline.ranks} pipeline ranks: launch exactly "
            f"{plan.pipeline.ranks} processes (nnodes x nproc-per-node)."
        )
    if resolve_device_type(cfg.train.device) == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=cfg.launch.timeout_s))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(cfg.train.cpu_threads)))
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.launch.timeout_s))
    return RunContext(cfg, plan, dist.get_rank(), world, local_rank, device, Path(run_dir))
