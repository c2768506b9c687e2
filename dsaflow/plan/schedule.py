"""Pipeline schedule rules: ranks, virtual stages, stage -> rank placement, microbatch constraints.

Placement follows torch.distributed.pipelining:
  * looped (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble): stage s lives on rank s % R;
  * V (ZBVZeroBubble, exactly 2 stages per rank): rank r owns stages r and 2R-1-r, so the first and last stage
    share rank 0 and the turn-around at the middle needs no send.
"""

from __future__ import annotations

from typing import List

from dsaflow.errors import PlanError
from dsaflow.plan.plan import PipelinePlan

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")  # the rest of dsaflow.config.schema.Schedule runs several stages/rank
# Schedules whose microbatch count must divide by the ranks. Recent torch relaxes this to a multiple of
# max(1, microbatches // ranks) "rounds"; the strict rule is the one every torch >= 2.6 accepts.
ROUND_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def resolve_pipeline(pipe, num_stages: int, *, mode: str, batch_size: int, nproc, parallel=None) -> PipelinePlan:
    """Check the schedule against the stage count and the data parallelism (`parallel`: the config's
    ParallelConfig, None = one replica); returns ranks, schedule, microbatches, stages per rank and dp."""
    dp = 1 if parallel is None else int(parallel.dp)
    cp = 1 if parallel is None else int(getattr(parallel, "cp", 1))
    dp_shard = True if parallel is None else bool(parallel.dp_shard)
    ranks = num_stages if pipe.ranks is None else pipe.ranks
    if num_stages % ranks != 0:
        raise PlanError(
            f"pipeline.ranks={ranks} does not divide the {num_stages} stages: every rank must own the same number "
            f"of virtual stages. Fix: use a stage count that is a multiple of {ranks} (pipeline.stages="
            f"{ranks * max(1, round(num_stages / ranks))}) or set pipeline.ranks to a divisor of {num_stages}."
        )
    v = num_stages // ranks
    if pipe.schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise PlanError(
            f"pipeline.schedule={pipe.schedule} runs one stage per rank, but {num_stages} stages on {ranks} ranks "
            f"gives {v} per rank. Fix: use pipeline.schedule=Interleaved1F1B (or LoopedBFS) for several stages per "
            f"rank, or set pipeline.ranks={num_stages}."
        )
    if pipe.schedule not in SINGLE_STAGE_SCHEDULES and v < 2:
        raise PlanError(
            f"pipeline.schedule={pipe.schedule} needs at least 2 stages per rank, but {num_stages} stages on {ranks} "
            f"ranks gives {v}. Fix: set pipeline.stages={2 * ranks} with pipeline.ranks={ranks}, or use "
            "pipeline.schedule=1F1B."
        )
    if pipe.schedule == "ZBVZeroBubble" and v != 2:
        raise PlanError(
            f"pipeline.schedule=ZBVZeroBubble needs exactly 2 stages per rank (V placement), got {v} "
            f"({num_stages} stages on {ranks} ranks). Fix: pipeline.stages={2 * ranks}."
        )
    mb = num_stages if pipe.microbatches is None else pipe.microbatches
    if mode == "train":  # serving runs no training schedule: only placement matters there
        _check_data_parallel_batch(batch_size, dp, mb)
        _check_training_microbatches(pipe, mb, ranks, num_stages, batch_size // dp)
    # mode=serve: parallel.dp is the number of serving replicas, each a whole pipeline with a share of the requests
    world = ranks * dp * cp
    if nproc is not None and nproc != world:
        cp_text = f" x parallel.cp={cp}" if cp > 1 else ""
        raise PlanError(
            f"--nproc {nproc} but the plan has {ranks} pipeline rank{'s' * (ranks != 1)} x parallel.dp={dp}{cp_text} "
            f"= {world} processes (one process per rank of every replica). Fix: drop --nproc or use --nproc {world}"
            + (
                f", or parallel.dp={nproc // (ranks * cp)} for {nproc} processes."
                if nproc % (ranks * cp) == 0
                else f" ({nproc} is not a multiple of the {ranks * cp} ranks of one replica)."
            )
        )
    return PipelinePlan(
        ranks=ranks, schedule=str(pipe.schedule), microbatches=mb, stages_per_rank=v, dp=dp, dp_shard=dp_shard, cp=cp
    )


# schedules whose backward is split into an input and a weight pass (torch's stage_backward_input / _weight)
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


def check_sharded_training(cfg, pipeline: PipelinePlan) -> None:
    """What parallel.dp_shard=true (FSDP2) does not run yet, refused by name with the fix: the split-backward
    schedules. FSDP2 reduces gradients from autograd hooks on a stage's inputs, which fire in the input-gradient
    pass, before the weight gradients exist; the weight pass (torch's stage_backward_weight) runs outside them, so
    the weight gradients would stay on the gathered weights and never reach the shards."""
    if pipeline.replicas == 1 or not pipeline.dp_shard or cfg.mode != "train":
        return
    if pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise PlanError(
            f"pipeline.schedule={pipeline.schedule} splits each backward into an input-gradient and a later "
            f"weight-gradient pass, which parallel.dp_shard=true (FSDP2 sharding over parallel.dp={pipeline.dp}) "
            "does not run yet: FSDP2 reduce-scatters from hooks that fire in the input-gradient pass, before the "
            "weight gradients exist, so they would never reach the shards. Fix: parallel.dp_shard=false (whole "
            "stages, gradients all-reduced after "
            "the schedule), or a schedule without split backward (pipeline.schedule=Interleaved1F1B or 1F1B)."
        )


def _check_data_parallel_batch(batch_size: int, dp: int, mb: int) -> None:
    """train.batch_size is the global batch: with dp > 1 it must split into dp replicas of `mb` equal
    microbatches (at dp=1 the microbatch rule alone applies)."""
    if dp > 1 and batch_size % (dp * mb) != 0:
        raise PlanError(
            f"train.batch_size={batch_size} does not split over parallel.dp={dp} replicas of "
            f"pipeline.microbatches={mb} equal microbatches (train.batch_size is the global batch: each replica "
            f"trains train.batch_size / parallel.dp sequences per step). Fix: train.batch_size="
            f"{dp * mb * max(1, batch_size // (dp * mb))} (a multiple of parallel.dp x pipeline.microbatches = "
            f"{dp * mb}), or fewer replicas or microbatches."
        )


def _check_training_microbatches(pipe, mb: int, ranks: int, num_stages: int, batch_size: int) -> None:
    if pipe.schedule in ROUND_SCHEDULES and mb % ranks != 0:
        raise PlanError(
            f"pipeline.microbatches={mb} is not a multiple of pipeline.ranks={ranks}, which {pipe.schedule} "
            f"requires. Fix: pipeline.microbatches={ranks * max(1, -(-mb // ranks))}."
        )
    if pipe.schedule == "1F1B" and mb < num_stages:
        raise PlanError(
            f"pipeline.microbatches={mb} is below the {num_stages} stages, which 1F1B rejects. Fix: "
            f"pipeline.microbatches={num_stages} (or more), or pipeline.schedule=GPipe."
        )
    if batch_size % mb != 0:  # batch_size: one replica's sequences per step (the global batch at dp=1)
        raise PlanError(
            f"train.batch_size={batch_size} does not split into pipeline.microbatches={mb} equal microbatches. "
            f"Fix: make train.batch_size a multiple of {mb} (e.g. train.batch_size={mb * max(1, batch_size // mb)})."
        )


def stage_ranks(num_stages: int, pipeline: PipelinePlan) -> List[int]:
    """rank of each stage: looped placement, or V placement for ZBVZeroBubble."""
    R = pipeline.ranks
    if pipeline.schedule == "ZBVZeroBubble":
        return [s if s < R else 2 * R - 1 - s for s in range(num_stages)]
    return [s % R for s in range(num_stages)]


def microbatches_in_flight(stage: int, rank: int, pipeline: PipelinePlan) -> int:
    """How many microbatches' activations a stage holds at its peak (drives its activation memory).

    GPipe runs every forward before any backward: all microbatches. 1F1B-style schedules warm up with
    (ranks - rank) forwards before the first backward; interleaved ones keep at most that many per local stage.
    Rough by design: it is what the estimate column multiplies by, and the doc says so."""
    if pipeline.schedule in ("GPipe", "LoopedBFS"):
        return pipeline.microbatches
    return max(1, min(pipeline.microbatches, pipeline.ranks - rank))
