"""A layer's place in the IndexCache layout, as the model needs it (the planner's LayerPlan has the same fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LayerSpec:
    """index: the layer's global index (state-dict keys use it); role: "F" (runs its indexer) or "S" (reuses
    indices); source: the F layer whose indices an S layer reads (None or `index` for an F layer)."""

    index: int = 0
    role: str = "F"
    source: Optional[int] = None
