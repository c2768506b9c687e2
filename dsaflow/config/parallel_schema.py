"""`parallel.*`: data parallelism around the pipeline (the pipeline itself is `pipeline.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import num


@dataclass
class ParallelConfig:
    """Data parallelism around the pipeline: `dp` replicas of the whole pipeline, each on its own pipeline ranks.

    World size = pipeline ranks x dp x cp. Global rank = (dp index x cp + cp index) x pipeline ranks + pipeline rank
    (pipeline rank is the inner, contiguous dimension, so a node of 8 GPUs holds whole pp8 pipelines and only data parallelism crosses
    nodes). `train.batch_size` stays the global batch: each replica trains batch_size / dp sequences per step, in
    pipeline.microbatches microbatches (docs/training.md, "Pipeline x data parallelism")."""

    dp: int = num(1, 1, 65536)
    # true: each stage's parameters, gradients and AdamW state are sharded over its dp group with FSDP2's
    # fully_shard (gathered once per step, kept for the pipeline's microbatches, gradients reduce-scattered after
    # the last backward); false: every replica holds the whole stage and gradients are all-reduced once per step
    dp_shard: bool = True
    # context parallelism (training): each sequence is split over `cp` ranks in zigzag chunks, which gather only the
    # attention's compact keys per layer; world size = pipeline ranks x dp x cp, and each stage's parameters are
    # sharded (or replicated) over its dp x cp ranks as over dp (docs/training.md, "Long context")
    cp: int = num(1, 1, 4096)
