"""What a worker process knows about itself: config, plan, rank, device, process groups, run dir.

Built from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). Training and serving
(`dsaflow.serve.generate.run_serve(ctx)`) both receive this object.

With data parallelism (parallel.dp > 1) or context parallelism (parallel.cp > 1) the world is a 2-D DeviceMesh
("dp", "pp") whose "dp" dimension holds the dp x cp ranks of each pipeline rank: global rank = (dp index x cp + cp
index) x pipeline ranks + pipeline rank (`PipelinePlan.global_rank`). `rank` and `group` are then the pipeline rank and the
replica's pipeline group (its p2p peers are that replica's ranks), `dp_rank` and `dp_group` the replica index and
the ranks that hold the same stages in every replica (gradients, expert load and metrics reduce there).
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
    group: Optional[dist.ProcessGroup] = None  # the replica's pipeline group; None = the default (world) group
    dp_rank: int = 0  # which replica this process belongs to (parallel.dp)
    # this pipeline rank in every replica and cp rank (dp x cp ranks); None when dp x cp == 1
    dp_group: Optional[dist.ProcessGroup] = None
    dp_mesh: Any = None  # the 1-D DeviceMesh of dp_group (FSDP2 shards over it); None when dp x cp == 1
    cp_rank: int = 0  # this process's place among the cp ranks that share its sequences (parallel.cp)
    cp_group: Optional[dist.ProcessGroup] = None  # those cp ranks; None when cp == 1

    @property
    def dp(self) -> int:
        return self.plan.pipeline.dp

    @property
    def cp(self) -> int:
        return self.plan.pipeline.cp

    @property
    def replicas(self) -> int:
        """The size of dp_group: the ranks holding this rank's stages (dp x cp)."""
        return self.plan.pipeline.replicas

    @property
    def replica_index(self) -> int:
        """This rank's place in dp_group (0 for replica 0's cp rank 0)."""
        return self.dp_rank * self.cp + self.cp_rank

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
        """The last stage's rank of replica 0 (cp rank 0): metrics are reduced over dp x cp before it logs them."""
        return self.rank == self.logging_rank and self.replica_index == 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def init_distributed(cfg, plan: Plan, run_dir: Path) -> RunContext:
    """Initialise the default process group from torchrun's env: NCCL on GPUs (one per local rank), gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world != plan.pipeline.world_size:
        raise RuntimeError(
            f"WORLD_SIZE={world} but {run_dir}/plan.json has {plan.pipeline.world_size} ranks (pipeline ranks x "
            f"parallel.dp): launch exactly {plan.pipeline.world_size} processes (nnodes x nproc-per-node)."
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
    return context_in_world(cfg, plan, run_dir, device, local_rank)


def context_in_world(cfg, plan: Plan, run_dir, device: torch.device, local_rank: int = 0) -> RunContext:
    """The RunContext of this process in an initialised default process group of plan.pipeline.world_size ranks.
    dp x cp == 1: the world is the pipeline. Otherwise a ("dp", "pp") DeviceMesh whose "dp" dimension is the
    dp x cp ranks holding the same stages (FSDP2 shards over it), plus, with cp > 1, one group per pipeline rank and
    replica holding the cp ranks that share its sequences."""
    world = dist.get_world_size()
    p = plan.pipeline
    if world != p.world_size:
        raise RuntimeError(f"world size {world} but the plan has {p.world_size} ranks")
    if p.replicas == 1:
        return RunContext(cfg, plan, dist.get_rank(), world, local_rank, device, Path(run_dir))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (p.replicas, p.ranks), mesh_dim_names=("dp", "pp"))
    me = dist.get_rank()
    dp_rank, pp_rank = p.mesh_coords(me)
    cp_rank = p.cp_index(me)
    if (mesh.get_local_rank("dp"), mesh.get_local_rank("pp")) != (dp_rank * p.cp + cp_rank, pp_rank):
        raise RuntimeError(f"DeviceMesh placed rank {me} apart from PipelinePlan.global_rank")
    cp_group = None
    for d in range(p.dp):  # every process creates every group, in the same order
        for r in range(p.ranks):
            if p.cp > 1:
                group = dist.new_group([p.global_rank(d, r, c) for c in range(p.cp)])
                cp_group = group if (d, r) == (dp_rank, pp_rank) else cp_group
    return RunContext(
        cfg,
        plan,
        pp_rank,
        world,
        local_rank,
        device,
        Path(run_dir),
        group=mesh.get_group("pp"),
        dp_rank=dp_rank,
        dp_group=mesh.get_group("dp"),
        dp_mesh=mesh["dp"],
        cp_rank=cp_rank,
        cp_group=cp_group,
    )
