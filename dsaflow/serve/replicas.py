"""Serving replicas: `dsaflow generate parallel.dp=N` runs N independent pipelines, each serving a share of the
requests, and writes one output in input order.

parallel.dp is the one knob for replicas in both modes (in training they are data-parallel replicas; serving has
no `serve.replicas`, which would be a second name for the same processes). The world is the ("dp", "pp") mesh of
`dsaflow.pipeline.run_context`: replica d runs its pipeline on global ranks d x ranks .. d x ranks + ranks - 1 and
sends only to those (`RunContext.global_rank`, the engine's `peer`). Nothing crosses replicas while they serve.

Shares: replica d serves the requests that fit at positions d, d + N, d + 2N, ... of the served list (round-robin in
input order, the same on every rank, no communication): a prompts file sorted by length still spreads its long
requests evenly. A replica with an empty share (fewer requests than replicas) serves nothing and waits at the gather.

Gather: the last stage's ranks of all replicas are one dp group (the same pipeline rank in every replica). When
every replica is done they all-gather their `ReplicaResult`s there, and replica 0's last-stage rank merges them back
into input order and is the only writer of serve.output_file (one atomic write, as at dp=1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist


def replica_share(served: List[int], dp: int, dp_rank: int) -> List[int]:
    """The request indices (of `served`, in input order) that replica `dp_rank` of `dp` serves: every dp-th."""
    return served[dp_rank::dp]


@dataclass
class ReplicaResult:
    """What one replica's last stage reports after serving its share: tokens per request index (input order
    indices of the whole job), their time to first token and per output token, and the replica's totals."""

    replica: int
    tokens: Dict[int, List[int]] = field(default_factory=dict)
    ttft_s: Dict[int, float] = field(default_factory=dict)
    tpot_s: Dict[int, float] = field(default_factory=dict)
    output_tokens: int = 0
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-9)


def gather_results(ctx, mine: ReplicaResult) -> Optional[List[ReplicaResult]]:
    """Call on the last stage's rank of every replica -> every replica's result, by replica, on replica 0 (None on
    the others). The dp group of that pipeline rank is exactly the last-stage ranks of all replicas."""
    if ctx.dp == 1:
        return [mine]
    got: List[Optional[ReplicaResult]] = [None] * ctx.dp
    dist.all_gather_object(got, mine, group=ctx.dp_group)  # a few KiB per replica: tokens and two floats a request
    return sorted(got, key=lambda r: r.replica) if ctx.dp_rank == 0 else None


def merged(results: List[ReplicaResult]) -> ReplicaResult:
    """The job as a whole: every replica's requests, tokens summed, wall = the slowest replica (they start together
    after a barrier), so tokens_per_s is the job's throughput."""
    out = ReplicaResult(replica=-1)
    for r in results:
        out.tokens.update(r.tokens)
        out.ttft_s.update(r.ttft_s)
        out.tpot_s.update(r.tpot_s)
        out.output_tokens += r.output_tokens
        out.wall_s = max(out.wall_s, r.wall_s)
    return out


def replica_lines(results: List[ReplicaResult], pipeline_ranks: int) -> List[str]:
    """One line per replica and a total: requests, output tokens, wall time, tokens/s."""
    lines = [
        f"replica {r.replica} (ranks {r.replica * pipeline_ranks}-{(r.replica + 1) * pipeline_ranks - 1}): "
        f"{r.output_tokens} tokens for {r.requests} requests in {r.wall_s:.2f} s ({r.tokens_per_s:.1f} tokens/s)"
        for r in results
    ]
    total = merged(results)
    lines.append(
        f"all {len(results)} replicas: {total.output_tokens} tokens for {total.requests} requests in "
        f"{total.wall_s:.2f} s ({total.tokens_per_s:.1f} tokens/s; wall = the slowest replica)"
    )
    return lines
