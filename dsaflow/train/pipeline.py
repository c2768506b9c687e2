"""Pipeline plumbing: plan stages -> torch.distributed.pipelining stages -> the configured schedule.

TrainStage wraps a StageModule for the schedule. The indexer KL loss is stage-local (S layers never cross a stage,
and the indexer's inputs and targets are detached), so its graph touches only this stage's indexer weights. With
sparse attention it runs inside the stage's backward (`IndexerLossInBackward`, dsaflow.model.indexer_loss): each F
layer's KL runs right after its group's attention backward, from the target that backward filled, and seeds its
gradient with `train.indexer_loss_weight`. Otherwise it reaches autograd through `attach_aux_loss`: an identity on
the stage output whose backward also seeds the indexer loss. Either way the schedule carries only the LM loss,
nothing calls `.backward()` inside a forward, and the indexer gradient is produced by the stage's own backward under
every schedule (also the zero-bubble ones, whose split input/weight backward finds the indexer weights through the
identity node, which lies on the path from the stage input to its output). Both gradients sit in the same `.grad`
buffers, and the schedule's end-of-step `scale_grads(n_microbatches)` turns both sums into microbatch means.

With pipeline.cross_stage_indices a stage that sends indices returns (output, indices int32 [b, T, topk]) and the
next stage takes them as its second input: the schedule moves them forward with the activations under every
schedule, and sends no gradient back for them (distillation stays stage-local, docs/planning.md).

TimedPipelineStage records the compute time of every forward / backward / weight-backward chunk (CUDA events on a
GPU, so pipeline waits are excluded), which gives per-stage busy time and the measured pipeline efficiency.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from dsaflow.data import IGNORE
from dsaflow.model import IndexerLossInBackward, attach_aux_loss, trim_indices
from dsaflow.model.mtp import mtp_targets


class TrainStage(nn.Module):
    """x -> stage(x, attn=self.attn), with the stage's indexer loss attached to the output (`attach_aux_loss`).

    `attn` ("sparse" | "dense") is an attribute, not a forward argument, because the schedule only forwards
    activations. `indexer_losses` collects the detached per-microbatch values for logging (sparse attention: once
    the microbatch's backward has run).

    `live` is set by TimedPipelineStage only around a real microbatch forward. torch's pipelining also calls the
    module to infer shapes (2.13: under enable_grad, on uninitialised tensors for non-first stages); such calls
    must not compute an indexer loss, or garbage gradients could reach the indexers, nor count MoE expert load."""

    def __init__(
        self, stage: nn.Module, indexer_loss_weight: float = 1.0, sends_indices: bool = False, runs_mtp: bool = True
    ):
        super().__init__()
        self.stage = stage
        self.attn = "sparse"
        self.live = False
        self.sends_indices = sends_indices
        self.in_backward = IndexerLossInBackward(indexer_loss_weight)  # holds the weight for both loss paths
        self.indexer_losses: List[torch.Tensor] = self.in_backward.values
        self.mtp_tokens: List[torch.Tensor] = []  # the MTP layers' input ids, one [b, T] per microbatch, in order
        # whether a last stage's MTP layers run in its training forwards (runs_mtp=False: parallel.cp > 1, where the
        # planner allows them only at train.mtp_loss_weight=0; they are then carried through untouched)
        self.runs_mtp = runs_mtp and getattr(stage, "mtp", None) is not None

    def feed_mtp_tokens(self, x: torch.Tensor, microbatches: int) -> None:
        """A last stage with MTP layers: the step's input ids x [B, T], split as the schedule splits the batch.
        The MTP layers read the tokens after each position (dsaflow.model.mtp), which only stage 0 receives; every
        rank draws the same batch, so this rank splits its own copy. Every schedule runs a stage's forwards in
        microbatch order, so each live forward takes the next one."""
        self.mtp_tokens = list(x.tensor_split(microbatches)) if self.runs_mtp else []

    def _next_mtp_tokens(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.runs_mtp:
            return None
        if not self.live:  # shape inference: any ids of the microbatch's shape
            return torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        if not self.mtp_tokens:
            raise RuntimeError("the last stage's MTP layers ran a microbatch with no input ids fed (feed_mtp_tokens)")
        return self.mtp_tokens.pop(0)

    def forward(self, x: torch.Tensor, indices: Optional[torch.Tensor] = None):
        """x: token ids [b, T] (first stage) or hidden [b, T, dim]; indices int32 [b, T, topk]: what the previous
        stage sends when this one opens on S layers (pipeline.cross_stage_indices). Returns the output, and with
        `sends_indices` also the indices the next stage reads (an int tensor: the schedule sends it forward and,
        since it needs no gradient, nothing back), trimmed to [b, T, min(topk, T)] (`trim_indices`)."""
        learn = self.live and torch.is_grad_enabled()
        if indices is not None and not self.live:  # shape inference hands in uninitialised ids: keep them in range
            indices = torch.zeros_like(indices)
        mtp = self._next_mtp_tokens(x)
        if learn and self.attn == "sparse":
            out, sent = self.stage.forward_with_indices(
                x,
                indices,
                attn="sparse",
                indexer_loss_in_backward=self.in_backward,
                record_expert_load=True,
                mtp_tokens=mtp,
            )
            return (out, trim_indices(sent)) if self.sends_indices else out
        out, sent = self.stage.forward_with_indices(
            x, indices, attn=self.attn, compute_indexer_loss=learn, record_expert_load=learn, mtp_tokens=mtp
        )
        loss = self.stage.indexer_loss
        self.stage.indexer_loss = None
        if learn and loss is not None and loss.requires_grad:
            self.indexer_losses.append(loss.detach())
            out = attach_aux_loss(out, loss, self.in_backward.weight)
        return (out, trim_indices(sent)) if self.sends_indices else out


class ChunkTimer:
    """Sums compute time of chunks: CUDA events (no host sync per chunk) or perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._events: list = []
        self._cpu = 0.0

    def run(self, fn: Callable, *args, **kwargs):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self._cpu += time.perf_counter() - t0
        return out

    def seconds(self) -> float:
        """Total since reset (synchronises on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        return self._cpu


class TimedPipelineStage(PipelineStage):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = ChunkTimer(self.device)

    def forward_one_chunk(self, *args, **kwargs):
        self.submod.live = True
        try:
            return self.timer.run(super().forward_one_chunk, *args, **kwargs)
        finally:
            self.submod.live = False

    def backward_one_chunk(self, *args, **kwargs):
        # A stage sharded over dp (dsaflow/train/data_parallel.py) accumulates whole gradients locally and
        # reduce-scatters them once, in the step's last backward (the schedule says which one that is).
        sharded = getattr(self.submod.stage, "set_requires_gradient_sync", None)
        if sharded is None:
            return self.timer.run(super().backward_one_chunk, *args, **kwargs)
        sharded(bool(kwargs.get("last_backward", False)))
        try:
            return self.timer.run(super().backward_one_chunk, *args, **kwargs)
        finally:
            sharded(True)  # outside the schedule (torch's shape inference) a backward reduces at once

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self.timer.run(super().backward_weight_one_chunk, *args, **kwargs)


class LMLoss:
    """Per-microbatch loss for the schedule, plus retrieval-accuracy counters (no host sync).

    out, target [b, 3, T] (row 0 LM targets, row 1 answers, -100 = ignored; row 2 query id of each answer position,
    -1 = none) -> scalar mean cross-entropy. `out` is the last stage's output: with `head` (the last StageModule,
    built with head_in_loss) its final hidden state [b, T, dim], turned into the loss by `head.lm_loss` in chunks of
    `chunk_tokens` rows (train.loss_chunk_tokens), so no [b, T, vocab] logits exist; without, fp32 logits
    [b, T, V]. A query counts as correct when the argmax matches at every one of its answer positions (exact
    match).

    A last stage with D MTP layers returns [b, 1 + D, T, dim] (with `head`: what the head reads at every depth,
    index 0 the final hidden state after the final norm, index k MTP depth k's output after its head_norm; no norm
    is applied here) or [b, 1 + D, T, V] logits: the loss is then the LM loss
    plus mtp_weight (train.mtp_loss_weight) x the mean over depths of each depth's cross-entropy (depth k learns
    lm[i + k] at position i), each depth through the same chunked head.

    Context parallel (`cp`, the head's ContextParallel): out and target hold this rank's zigzag shard. The loss is
    cp x (this shard's sum) / (the whole sequences' count of targets), so that its mean over the cp ranks (what the
    dp x cp gradient average and metrics take) is the whole sequences' mean; a query's answer positions may sit on
    several ranks, so their hits are combined over the cp group and cp rank 0 alone counts them. (The planner
    refuses MTP training under cp: dsaflow/plan/cp_rules.py.)"""

    def __init__(
        self,
        num_queries: int = 0,
        head: Optional[nn.Module] = None,
        chunk_tokens: int = 0,
        cp=None,
        mtp_weight: float = 0.0,
    ):
        self.num_queries = num_queries  # answers per sample (0: no accuracy); static, so no host sync
        self.head, self.chunk_tokens, self.cp = head, chunk_tokens, cp
        self.mtp_weight = mtp_weight  # train.mtp_loss_weight
        self.reset()

    def reset(self) -> None:
        self.correct: torch.Tensor | int = 0
        self.total: torch.Tensor | int = 0
        self.lm_losses: List[torch.Tensor] = []  # with MTP outputs: each microbatch's LM loss and MTP loss, detached
        self.mtp_losses: List[torch.Tensor] = []

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        lm, ans, qid = target[:, 0], target[:, 1], target[:, 2]
        mtp = out[:, 1:] if out.dim() == 4 else None
        out = out[:, 0] if mtp is not None else out
        loss, argmax = self._lm_loss(out, lm, normed=mtp is not None)
        if self.num_queries > 0:
            self._count_answers(argmax, ans, qid)
        if mtp is None:
            return loss
        if self.cp is not None:
            raise RuntimeError("MTP outputs under context parallelism: the planner refuses this (cp_rules.py)")
        mtp_loss = torch.stack([self._depth_loss(mtp[:, k - 1], lm, k) for k in range(1, mtp.shape[1] + 1)]).mean()
        self.lm_losses.append(loss.detach())
        self.mtp_losses.append(mtp_loss.detach())
        return loss + self.mtp_weight * mtp_loss

    def _lm_loss(self, out: torch.Tensor, lm: torch.Tensor, normed: bool):
        """The LM loss of `out` (with `head` hidden [b, T, dim], after the final norm when `normed`; else logits
        [b, T, V]) -> (loss, argmax [b, T] or None, when no accuracy is counted)."""
        want_argmax = self.num_queries > 0
        if self.cp is not None:
            total, argmax = self.head.lm_loss(
                out, lm, self.chunk_tokens, want_argmax=want_argmax, reduction="sum", normed=normed
            )
            count = (lm != IGNORE).sum()
            dist.all_reduce(count, group=self.cp.comm.group)
            return total * self.cp.size / count, argmax
        if self.head is not None:
            return self.head.lm_loss(out, lm, self.chunk_tokens, want_argmax=want_argmax, normed=normed)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), lm.reshape(-1), ignore_index=IGNORE)
        return loss, out.detach().argmax(dim=-1) if want_argmax else None

    @torch.no_grad()
    def _count_answers(self, argmax: torch.Tensor, ans: torch.Tensor, qid: torch.Tensor) -> None:
        """Adds this microbatch's exactly matched queries and seen queries to the counters."""
        n_q = self.num_queries
        slot = torch.where(qid >= 0, qid, torch.full_like(qid, n_q))  # non-answers go to a spare slot
        hit = (argmax == ans).long()
        ok = torch.ones(qid.shape[0], n_q + 1, dtype=torch.long, device=qid.device)
        ok.scatter_reduce_(1, slot, hit, reduce="amin")
        seen = torch.zeros_like(ok).scatter_reduce_(1, slot, torch.ones_like(hit), reduce="amax")
        if self.cp is not None:  # every rank's answer positions of each query
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.cp.comm.group)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.cp.comm.group)
            seen = seen * int(self.cp.rank == 0)
        self.correct = self.correct + (ok[:, :n_q] * seen[:, :n_q]).sum()
        self.total = self.total + seen[:, :n_q].sum()

    def _depth_loss(self, out: torch.Tensor, lm: torch.Tensor, depth: int) -> torch.Tensor:
        """Mean cross-entropy of MTP depth `depth` (its output [b, T, dim], already normed, with `head`; else its
        logits [b, T, V]) over its positions with a target (0 when there are none, without a host sync)."""
        want = mtp_targets(lm, depth, IGNORE)
        if self.head is not None:  # the shared LM head in chunks, no second norm
            total, _ = self.head.lm_loss(out, want, self.chunk_tokens, reduction="sum", normed=True)
        else:
            total = F.cross_entropy(
                out.reshape(-1, out.shape[-1]).float(), want.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
        return total / (want != IGNORE).sum().clamp_min(1)

    def accuracy(self) -> float:
        total = int(self.total)
        return float(int(self.correct) / total) if total else float("nan")


def build_pipeline_stages(
    modules: Sequence[nn.Module], stage_indices: Sequence[int], num_stages: int, device: torch.device, group=None
) -> List[TimedPipelineStage]:
    """One PipelineStage per local module. Shapes are inferred at the first step (no example inputs needed)."""
    return [TimedPipelineStage(m, s, num_stages, device, group=group) for m, s in zip(modules, stage_indices)]


def build_schedule(
    name: str, stages: List[PipelineStage], microbatches: int, loss_fn: Callable, scale_grads: bool = True
):
    """The torch schedule class `name` (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble, ...). Single-stage schedules take this rank's one stage, multi-stage ones the list.
    scale_grads=False: the caller turns the microbatch sums into means (stages sharded over dp, whose last
    gradients reach the shards only when the step's backward is complete: dsaflow/train/data_parallel.py)."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"pipeline.schedule={name} runs one stage per rank, this rank has {len(stages)}.")
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
