"""The collectives of context parallelism over a process group (the model's `ContextParallel.comm`): all-gather of
key rows and reduce-scatter of their gradient (dsaflow.model.context_parallel says what travels and when)."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from dsaflow.model.context_parallel import ContextParallel


class GroupComm:
    """group: the cp process group (None = the default group)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.gloo = dist.get_backend(group) == "gloo"

    def all_gather(self, local: torch.Tensor) -> List[torch.Tensor]:
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return parts

    def reduce_scatter(self, parts: List[torch.Tensor]) -> torch.Tensor:
        """The sum over ranks of parts[this rank]. gloo has no reduce-scatter: it all-reduces every part and keeps
        its own (the same sum, size times the traffic; CPU runs are for tests)."""
        if self.gloo:
            whole = torch.stack(parts)
            dist.all_reduce(whole, group=self.group)
            return whole[self.rank].clone()
        out = torch.empty_like(parts[self.rank])
        dist.reduce_scatter(out, parts, group=self.group)
        return out


def context_parallel(group: Optional[dist.ProcessGroup] = None) -> ContextParallel:
    """This process's ContextParallel over `group`."""
    comm = GroupComm(group)
    return ContextParallel(comm.rank, comm.size, comm)
