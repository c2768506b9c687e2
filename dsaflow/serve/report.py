"""What a rank reports: the capture report (which graph blocks it captured, for which shape classes, where, and at
what memory cost) and the statistics of a generation (`run_stats`).

Every rank builds one after capture, prints it, logs it and writes `graphs_rank<r>.json` into the run dir. A requested
(block, shape class) that ended neither captured nor explicitly eager (`graphs.on_failure=eager`) is an error:
`check_complete` raises `MissingGraphError` naming what is missing and what was captured.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple


class MissingGraphError(RuntimeError):
    """A requested graph block / shape class was not captured on this rank."""


@dataclass(frozen=True)
class CaptureRecord:
    block: str
    kind: str  # decode | prefill
    shape_class: int
    device: str
    stage: int
    status: str  # "captured" | "eager" (on_failure=eager after a failure, or graphs impossible and eager allowed)
    pool_bytes: int = 0  # growth of the device's reserved memory during this capture (the graph pool's share)
    capture_ms: float = 0.0
    reason: Optional[str] = None  # why a block runs eagerly

    @property
    def captured(self) -> bool:
        return self.status == "captured"


@dataclass
class CaptureReport:
    rank: int
    records: List[CaptureRecord]
    cache: bool = True  # graphs.cache (false = every call evicts and recaptures)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "cache": self.cache,
            "captured": sum(r.captured for r in self.records),
            "eager": sum(not r.captured for r in self.records),
            "pool_bytes": sum(r.pool_bytes for r in self.records),
            "records": [asdict(r) for r in self.records],
        }

    def write_json(self, run_dir: str) -> str:
        path = os.path.join(run_dir, f"graphs_rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path

    def render(self) -> str:
        """A plain-text table, one line per (block, shape class)."""
        head = (
            f"{'block':<12} {'kind':<8} {'class':>6} {'stage':>5} {'device':<8} {'status':<9} {'pool MiB':>9} {'ms':>8}"
        )
        lines = [f"CUDA graph capture report, rank {self.rank} (graphs.cache={str(self.cache).lower()})", head]
        for r in self.records:
            lines.append(
                f"{r.block:<12} {r.kind:<8} {r.shape_class:>6} {r.stage:>5} {r.device:<8} {r.status:<9} "
                f"{r.pool_bytes / 2**20:>9.2f} {r.capture_ms:>8.1f}" + (f"  ({r.reason})" if r.reason else "")
            )
        if not self.records:
            lines.append("(no graph blocks requested on this rank)")
        d = self.to_dict()
        lines.append(f"total: {d['captured']} captured, {d['eager']} eager, pool {d['pool_bytes'] / 2**20:.2f} MiB")
        return "\n".join(lines)


def check_complete(
    requested: Iterable[Tuple[str, int, int]], records: Sequence[CaptureRecord], allow_eager: bool
) -> None:
    """Raise MissingGraphError unless every requested (block, stage, shape class) has a record that is captured (or
    eager, when `allow_eager`, i.e. graphs.on_failure=eager)."""
    have = {(r.block, r.stage, r.shape_class): r for r in records}
    missing = []
    for key in requested:
        rec = have.get(tuple(key))
        if rec is None or not (rec.captured or (allow_eager and rec.status == "eager")):
            why = f" ({rec.status}: {rec.reason})" if rec else " (never captured)"
            missing.append(f"{key[0]}[{key[2]}] of stage {key[1]}{why}")
    if missing:
        done = ", ".join(f"{r.block}[{r.shape_class}]@{r.stage}" for r in records if r.captured) or "nothing"
        raise MissingGraphError(
            f"requested CUDA graph blocks were not captured: {', '.join(missing)}; captured: {done}. Fix the cause "
            f"above, or set graphs.on_failure=eager to run those blocks eagerly (reported as eager), or graphs=off."
        )


def run_stats(tl: Dict[str, Any], ticks: int, latencies: Tuple[Dict, Dict], tokens: int) -> Dict[str, Any]:
    """The engine's `stats` of one generation, from the resolved timeline (`Timeline.resolve`), the tick count, the
    per-request (time to first token, time per output token) of `Timeline.latencies` and the tokens emitted."""
    ttft, tpot = latencies
    return {
        "wall_s": tl["wall_s"],
        "ticks": ticks,
        "busy_fraction": tl["busy_fraction"],
        "decode_busy": tl["decode_busy"],
        "busy_after_prefill": tl["busy_after_prefill"],
        # ticks by kind (decode / prefill / mixed), the busy fraction of the mixed ticks, and the run as segments of
        # consecutive ticks of one kind (Timeline._kind_summary)
        **{k: tl[k] for k in ("tick_kinds", "mixed_busy", "tick_segments")},
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens": tokens,
        # where the host's time goes per decode tick, and whether the GPU waited on it (Timeline._host_summary)
        **{k: tl[k] for k in ("decode_host_ms_per_tick", "decode_lead_p50_ms", "decode_host_late")},
    }
