"""The Plan: what every process builds and runs, resolved before anything launches.

Frozen dataclasses that round-trip through `plan.json` (the JSON contract is documented in the README):

    {"num_layers": N,
     "stages": [{"index": s, "rank": r, "layers": [..]}],
     "layers": [{"index": i, "stage": s, "declared": "F"|"S", "role": "F"|"S", "promoted": bool, "source": j,
                 "reason": str|null}],
     "graph_blocks": [{"name", "kind", "stages", "layers", "shape_classes"}],
     "pipeline": {"ranks", "schedule", "microbatches", "stages_per_rank", "dp", "dp_shard", "cp"},
     "estimates": {..},
     "index_boundaries": [s, ..]}   # stages whose boundary to the next carries top-k indices (cross-stage)

`source` is the layer whose indices layer i uses (itself for an F layer); with cross-stage indices it may lie on
an earlier stage. Workers read the plan, never the planner.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class LayerPlan:
    index: int
    stage: int
    declared: str  # "F" | "S" as written in the config
    role: str  # "F" | "S" after promotion
    promoted: bool
    source: int  # layer whose index cache this layer reads (itself when F)
    reason: Optional[str] = None  # why a layer was promoted


@dataclass(frozen=True)
class StagePlan:
    index: int
    rank: int
    layers: Tuple[int, ...]


@dataclass(frozen=True)
class GraphBlockPlan:
    name: str
    kind: str  # decode | prefill | head | layers
    stages: Tuple[int, ...]  # stages that capture this block
    layers: Tuple[int, ...]  # layers inside the block (empty for whole-stage blocks)
    shape_classes: Tuple[int, ...]


@dataclass(frozen=True)
class PipelinePlan:
    ranks: int  # pipeline ranks of one replica
    schedule: str
    microbatches: int  # per replica and step
    stages_per_rank: int
    dp: int = 1  # data-parallel replicas of the whole pipeline (parallel.dp)
    dp_shard: bool = True  # FSDP2-shard each stage over its dp x cp group (parallel.dp_shard); no effect at 1
    cp: int = 1  # context-parallel ranks per sequence (parallel.cp)

    @property
    def world_size(self) -> int:
        """Processes of the run: pipeline ranks x dp x cp."""
        return self.ranks * self.dp * self.cp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same stages (dp x cp): a stage's parameters are sharded or averaged over them."""
        return self.dp * self.cp

    def global_rank(self, dp_index: int, pp_rank: int, cp_index: int = 0) -> int:
        """The process of pipeline rank `pp_rank` in replica `dp_index`, cp rank `cp_index`: the pipeline rank is
        the inner dimension, so one pipeline's ranks are contiguous (a pp group stays on one node when
        nproc-per-node is a multiple of the pipeline ranks), then cp, then dp."""
        return (dp_index * self.cp + cp_index) * self.ranks + pp_rank

    def mesh_coords(self, global_rank: int) -> tuple:
        """(dp index, pipeline rank) of a global rank."""
        outer, pp = divmod(global_rank, self.ranks)
        return outer // self.cp, pp

    def cp_index(self, global_rank: int) -> int:
        """The cp rank of a global rank (0 without context parallelism)."""
        return (global_rank // self.ranks) % self.cp


@dataclass(frozen=True)
class Plan:
    num_layers: int
    stages: Tuple[StagePlan, ...]
    layers: Tuple[LayerPlan, ...]
    graph_blocks: Tuple[GraphBlockPlan, ...] = ()
    pipeline: PipelinePlan = field(default_factory=lambda: PipelinePlan(1, "1F1B", 1, 1))
    estimates: Dict[str, Any] = field(default_factory=dict)
    # stages whose boundary to the next stage carries top-k indices (pipeline.cross_stage_indices)
    index_boundaries: Tuple[int, ...] = ()

    # --- queries used by the runtime -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_of_rank(self, rank: int) -> List[StagePlan]:
        return [s for s in self.stages if s.rank == rank]

    def layer(self, index: int) -> LayerPlan:
        return self.layers[index]

    def is_first(self, stage: int) -> bool:
        return stage == 0

    def is_last(self, stage: int) -> bool:
        return stage == len(self.stages) - 1

    def receives_indices(self, stage: int) -> bool:
        """Stage `stage` opens on S layers that read indices sent by the previous stage."""
        return stage - 1 in self.index_boundaries

    def sends_indices(self, stage: int) -> bool:
        """Stage `stage` sends its outgoing top-k indices to the next stage."""
        return stage in self.index_boundaries

    def blocks_of_stage(self, stage: int) -> List[GraphBlockPlan]:
        return [b for b in self.graph_blocks if stage in b.stages]

    # --- serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        for s in d["stages"]:
            s["layers"] = list(s["layers"])
        for b in d["graph_blocks"]:
            b["stages"], b["layers"], b["shape_classes"] = (
                list(b["stages"]),
                list(b["layers"]),
                list(b["shape_classes"]),
            )
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> Plan:
        return cls(
            num_layers=int(d["num_layers"]),
            stages=tuple(StagePlan(s["index"], s["rank"], tuple(s["layers"])) for s in d["stages"]),
            layers=tuple(LayerPlan(**l) for l in d["layers"]),
            graph_blocks=tuple(
                GraphBlockPlan(b["name"], b["kind"], tuple(b["stages"]), tuple(b["layers"]), tuple(b["shape_classes"]))
                for b in d.get("graph_blocks", [])
            ),
            pipeline=PipelinePlan(**d["pipeline"]) if "pipeline" in d else PipelinePlan(1, "1F1B", 1, 1),
            estimates=d.get("estimates", {}),
            index_boundaries=tuple(d.get("index_boundaries", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


__all__ = ["GraphBlockPlan", "LayerPlan", "PipelinePlan", "Plan", "StagePlan"]
