"""Data parallelism around the pipeline (parallel.dp replicas): how a stage's gradients and state meet across
replicas, once per optimiser step.

Each replica runs the whole pipeline on its share of the global batch (`replica_rows`). The ranks holding the same
stages in every replica form the dp group (`RunContext.dp_group`), and there:

  parallel.dp_shard=false   every replica holds whole stages; after the schedule's last backward each gradient is
                            averaged over the dp group in one flat all-reduce per dtype (`after_backward`)
  parallel.dp_shard=true    each StageModule is FSDP2's `fully_shard` over the dp mesh: parameters, gradients and
                            AdamW state are DTensors sharded on dim 0. The weights are gathered at the step's first
                            forward and stay gathered for every microbatch (reshard_after_forward=False and no
                            reshard after a backward, as pipelines need); the backward of every microbatch but the
                            last accumulates whole gradients locally (`set_requires_gradient_sync(False)`, set by
                            `TimedPipelineStage` from the schedule's `last_backward`), and the last one
                            reduce-scatters their sum once. `after_backward` then frees the gathered weights, so the
                            next forward gathers the updated ones. The dense warm-up backpropagates outside the
                            schedule, unseen by FSDP2's hooks: `after_stage_backward` reduces its gradients.

The schedule's `scale_grads(microbatches)` and the dp average make every gradient the global-batch mean, which is
what one replica with dp x the microbatches computes. MoE expert-load counts are summed over the dp group before the
bias update (`reduce_expert_load`), so every replica moves its routing biases identically.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dsaflow.model import moe_layers


def replica_rows(batch: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """Replica `dp_rank`'s contiguous share of a global batch [B, ...] -> [B / dp, ...]. With the pipeline's
    microbatches cut from it in order, replica d trains global microbatches d*m .. d*m+m-1 of the dp x m that one
    replica with dp x m microbatches would run."""
    if dp == 1:
        return batch
    return batch.tensor_split(dp)[dp_rank]


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class DataParallel:
    """ctx: the RunContext; modules: this rank's StageModules (on ctx.device, before any optimiser is built)."""

    def __init__(self, ctx, modules: Sequence[nn.Module]):
        self.ctx, self.modules = ctx, list(modules)
        # the ranks holding these stages: the dp replicas, each with its cp ranks (parallel.cp), whose gradients
        # are averaged alike (a cp rank's loss is scaled so that the average is the whole sequences' gradient)
        self.dp = ctx.replicas
        self.shard = self.dp > 1 and ctx.plan.pipeline.dp_shard
        if self.shard:
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for m in self.modules:
                fully_shard(m, mesh=ctx.dp_mesh, reshard_after_forward=False)
                m.set_reshard_after_backward(False)
                # the pipeline stage and the forward-only passes call this method, not forward()
                register_fsdp_forward_method(m, "forward_with_indices")

    @property
    def norm_group(self) -> Optional[dist.ProcessGroup]:
        """The group a gradient's squared norm is summed over: the world when gradients are sharded over dp (each
        rank holds a part), the replica's pipeline group when every replica holds the same whole gradients."""
        return None if self.shard else self.ctx.group

    def after_backward(self, microbatches: int) -> None:
        """Once per step, after the schedule (or the forward-only dense step): replicated stages average their
        gradients over the dp group; sharded stages drop their gathered weights (their gradients were
        reduce-scattered by the last backward) and divide the microbatch sums into means."""
        if self.dp == 1:
            return
        if self.shard:
            for m in self.modules:
                m.reshard()
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.div_(microbatches)
            return
        self._average([p.grad for m in self.modules for p in m.parameters() if p.grad is not None])

    def after_stage_backward(self) -> None:
        """Once per dense warm-up step, after the forward-only pass (dsaflow/train/forward_pass.py), whose gradients
        are microbatch means already. Replicated stages average them over the dp group as after a schedule.

        Sharded stages cannot leave this to FSDP2: it reduce-scatters from autograd hooks on a stage's inputs and
        outputs, and the warm-up's backward starts from the indexer loss, a side value those hooks never see, so its
        gradients stay on the gathered weights. Here they are taken off, averaged over the dp group in one
        all-reduce (the warm-up trains only the indexers, a small part of each stage, so reduce-scattering them
        would save little) and each rank keeps its dim-0 shard as the sharded parameter's gradient; the gathered
        weights are freed, as after a schedule."""
        if self.dp == 1:
            return
        if not self.shard:
            self.after_backward(1)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        whole: dict = {}  # (module, parameter name) -> the gradient left on its gathered weight
        for i, m in enumerate(self.modules):
            for name, p in m.named_parameters():
                if p.grad is not None and not isinstance(p, DTensor):
                    whole[i, name], p.grad = p.grad, None  # None: the next step's reduction must not see it again
            m.reshard()
        self._average(list(whole.values()))
        sharded = [dict(m.named_parameters()) for m in self.modules]
        for (i, name), g in whole.items():
            p = sharded[i][name]
            # every replica holds the same average: each keeps its chunk of it, no communication (src_data_rank=None)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)

    def _average(self, grads: Sequence[torch.Tensor]) -> None:
        """Each tensor replaced in place by its mean over the dp group: one flat all-reduce per dtype."""
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.ctx.dp_group)
            flat.div_(self.dp)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def after_forward_only(self) -> None:
        """After an evaluation: sharded stages drop the weights the forward gathered."""
        if self.shard:
            for m in self.modules:
                m.reshard()

    def reduce_expert_load(self) -> None:
        """Sum every MoE layer's routed-token counts over the dp group (before the bias update and its metric)."""
        if self.dp == 1:
            return
        loads = [layer.gate.expert_load for m in self.modules for layer in moe_layers(m).values()]
        if not loads:
            return
        flat = torch.cat(loads)
        dist.all_reduce(flat, group=self.ctx.dp_group)
        offset = 0
        for load in loads:
            load.copy_(flat[offset : offset + load.numel()])
            offset += load.numel()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
