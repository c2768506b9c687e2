"""Forward-only pipelined passes: evaluation, and the dense warm-up's training step. No schedule, no backward
through the pipeline.

Why the dense warm-up needs no pipeline backward: in that phase the main model is frozen (DSA recipe) and each
stage's indexer loss is local to it (the indexer's inputs and its KL target are detached), so the LM backward would
compute gradients nothing uses (on one H200, 2 layers at 16K tokens: 880 -> 694 ms per step and 21.7 -> 10.0 GiB
peak without it). Here each stage runs its forward with the main weights frozen, so autograd keeps only the
indexer's small graph, and backpropagates its own `indexer_loss_weight * indexer_loss` at once: the indexer
gradients equal the ones the schedule's backward produced (the same per-microbatch seeds, summed, then divided by
the number of microbatches as the schedule's `scale_grads` does).

The microbatches move through the stages on the pipeline schedule that serving uses (dsaflow.pipeline.ticks), in
a straight loop of their own: stage s runs microbatch m while stage s+1 runs m-1, each stage sees the microbatches in
order, and the moves of one tick are posted together. Hidden states travel in fp32 (the residual stream's dtype under
autocast).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from dsaflow.model import StageModule, trim_indices
from dsaflow.model.mtp import mtp_runs_in_training
from dsaflow.pipeline.p2p import StageLink, post_tick
from dsaflow.pipeline.run_context import RunContext
from dsaflow.pipeline.ticks import PipelineSchedule

from .pipeline import ChunkTimer


@contextlib.contextmanager
def frozen(params: Sequence[torch.nn.Parameter]):
    """requires_grad off for `params` inside the block (autograd then saves nothing for them)."""
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, w in zip(params, was):
            p.requires_grad_(w)


@dataclass
class Microbatch:
    """One microbatch's forward through every stage, as the pipeline schedule moves it (dsaflow.pipeline.ticks):
    group = its index; hidden [rows, T, dim] / hidden_dtype, the activation between stages; extra, the (shape,
    dtype) of the cross-stage indices that travel with it. No feedback: nothing returns to stage 0."""

    group: int
    hidden: tuple
    hidden_dtype: torch.dtype
    extra: tuple = ()
    feedback: Optional[tuple] = None
    decode_only: bool = False
    token_major: bool = False
    start: int = -1


class ForwardPipeline:
    """modules: this rank's StageModules, for `stage_indices` of ctx.plan; timers: one ChunkTimer per module."""

    def __init__(
        self,
        ctx: RunContext,
        modules: Sequence[StageModule],
        stage_indices: Sequence[int],
        timers: Sequence[ChunkTimer],
    ):
        self.ctx, self.plan = ctx, ctx.plan
        self.local: Dict[int, tuple] = {s: (m, t) for s, m, t in zip(stage_indices, modules, timers)}
        # Sharded stages (parallel.dp_shard): these are the shards; FSDP2 copies their requires_grad to the gathered
        # weights when it gathers them, at a step's first forward (DataParallel frees them after every step)
        self.main_params = [p for m in modules for n, p in m.named_parameters() if ".attn.indexer." not in n]
        self.link = StageLink(ctx.device) if self.plan.pipeline.ranks > 1 else None
        self.owner = {sp.index: sp.rank for sp in self.plan.stages}

    def run(
        self,
        x: Optional[torch.Tensor],
        y: Optional[torch.Tensor],
        losses: list,
        loss_fn: Callable,
        autocast: Callable,
        attn: str,
        indexer_weight: Optional[float] = None,
        indexer_losses: Optional[Dict[int, List[torch.Tensor]]] = None,
    ) -> None:
        """One batch in plan.pipeline.microbatches microbatches. x [B, T] token ids (ranks with stage 0, and with the
        last stage when it has MTP layers) and
        y [B, 3, T] targets (ranks with the last stage; the per-microbatch LM losses are appended to `losses`).
        indexer_weight None: no grad anywhere (evaluation). A float: every stage's indexer loss is backpropagated
        with that weight and its value appended to indexer_losses[stage]; the indexer gradients are the
        microbatch mean."""
        n_mb, S = self.plan.pipeline.microbatches, self.plan.num_stages
        learn = indexer_weight is not None
        xs = x.to(self.ctx.device).tensor_split(n_mb) if x is not None else None  # MTP layers read them too
        ys = y.to(self.ctx.device).tensor_split(n_mb) if y is not None else None

        def stage_fn(m: int, s: int, inp):
            """-> the stage's output, or (output, indices) where the boundary after it carries cross-stage indices
            (the previous stage's tuple arrives likewise)."""
            module, timer = self.local[s]
            indices = None
            if isinstance(inp, tuple):
                inp, indices = inp
            out, sent = timer.run(
                self._stage_forward,
                module,
                xs[m] if s == 0 else inp,
                autocast,
                attn,
                learn,
                indexer_weight,
                None if indexer_losses is None else indexer_losses.setdefault(s, []),
                indices if self.plan.receives_indices(s) else None,
                xs[m] if module.mtp is not None and mtp_runs_in_training(self.ctx.cfg) else None,
            )
            if s == S - 1:
                with torch.no_grad():
                    losses.append(loss_fn(out, ys[m]).detach())
            if self.plan.sends_indices(s):
                return out, trim_indices(sent)
            return out

        self._run_microbatches(n_mb, stage_fn)
        if learn:
            for module, _ in self.local.values():
                for p in module.indexer_parameters():
                    if p.grad is not None:
                        p.grad.div_(n_mb)

    def _run_microbatches(self, n_mb: int, stage_fn: Callable) -> None:
        """Every microbatch through this rank's stages, in order, one start per tick: at tick t segment j runs
        microbatch t - j, then the tick's activations move to the next segments' ranks in one batch."""
        extra = ((self._index_shape(), torch.int32),) if self.plan.index_boundaries else ()
        schedule = PipelineSchedule(self.owner, self.ctx.rank, self.ctx.global_rank, carries=self.plan.sends_indices)
        for t in range(n_mb + schedule.K - 1):
            new = Microbatch(t, self._hidden_shape(), torch.float32, extra) if t < n_mb else None
            outputs = []
            for j, mb, x in schedule.begin(t, new):
                for s in schedule.segments[j][1]:
                    x = stage_fn(mb.group, s, x)
                outputs.append((j, mb, x))
            ops, keys = schedule.transfers(t, outputs, None)
            if ops:
                schedule.deliver(keys, post_tick(self.link, ops, self.ctx.device))
            schedule.leave(t)

    def _hidden_shape(self) -> tuple:
        """[sequences per microbatch, T, dim] of a hidden state (train and eval batches have train.batch_size
        sequences, train.batch_size / parallel.dp per replica; the planner requires them to split evenly)."""
        t = self.ctx.cfg.train
        return (self._microbatch_rows(), t.seq_len // self.plan.pipeline.cp, self.ctx.cfg.model.dim)

    def _microbatch_rows(self) -> int:
        p = self.plan.pipeline
        return self.ctx.cfg.train.batch_size // (p.dp * p.microbatches)

    def _index_shape(self) -> tuple:
        """[sequences per microbatch, T, min(topk, T)]: the int32 indices a stage sends with cross-stage indices
        (`trim_indices`)."""
        t = self.ctx.cfg.train
        topk = min(self.ctx.cfg.model.index_topk, t.seq_len)
        return (self._microbatch_rows(), t.seq_len, topk)

    def _stage_forward(
        self,
        module: StageModule,
        inp: torch.Tensor,
        autocast: Callable,
        attn: str,
        learn: bool,
        weight: Optional[float],
        sink: Optional[list],
        indices: Optional[torch.Tensor],
        mtp_tokens: Optional[torch.Tensor] = None,
    ):
        """-> (output detached, the indices the next stage reads). mtp_tokens: the microbatch's input ids, for a
        last stage with MTP layers."""
        with torch.set_grad_enabled(learn), frozen(self.main_params if learn else []), autocast():
            out, sent = module.forward_with_indices(
                inp, indices, attn=attn, compute_indexer_loss=learn, mtp_tokens=mtp_tokens
            )
        loss, module.indexer_loss = module.indexer_loss, None
        if learn and loss is not None and loss.requires_grad:
            if sink is not None:
                sink.append(loss.detach())
            (loss * weight).backward()
        return out.detach(), sent
