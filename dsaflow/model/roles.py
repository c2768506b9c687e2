"""Switch the F/S roles of a built stage at run time (the IndexCache layer search; evaluating patterns on one model).

A stage built with every layer F owns an indexer in every layer. `set_roles(stage, roles)` makes some of them S:
an S layer keeps its indexer weights (untouched, so the layer can be made F again) but no longer runs them; it reads
the indices of the nearest preceding F layer of the same stage, exactly as a stage built from a plan with those
roles would. Only `role` and `source` of the block and of its attention change: no weights move.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

from .stage import StageModule


def stage_roles(stage: StageModule) -> Dict[int, str]:
    """{global layer index: "F" | "S"} of the stage as it will run now."""
    return {int(k): layer.role for k, layer in stage.layers.items()}


def set_roles(stage: StageModule, roles: Mapping[int, str], incoming_source: Optional[int] = None) -> None:
    """roles: {global layer index: "F" | "S"} for (a subset of) the stage's layers; layers not named keep their role.
    incoming_source: the F layer of an earlier stage whose indices the stage's opening S layers read (cross-stage
    indices), or None: then the stage's first layer must stay F.

    Raises ValueError if the stage's first layer would be S without an incoming source, or if a layer made F has no
    indexer weights (it was built as S: its checkpoint carries no indexer to run)."""
    ids = [int(k) for k in stage.layers.keys()]
    unknown = sorted(set(int(i) for i in roles) - set(ids))
    if unknown:
        raise ValueError(f"set_roles: layers {unknown} are not in this stage (layers {ids}).")
    want = {i: roles.get(i, stage.layers[str(i)].role) for i in ids}
    bad = sorted(r for r in want.values() if r not in ("F", "S"))
    if bad:
        raise ValueError(f"set_roles: roles must be 'F' or 'S', got {bad}.")
    if incoming_source is not None and incoming_source >= ids[0]:
        raise ValueError(f"set_roles: incoming_source={incoming_source} is not before the stage (layers {ids}).")
    if want[ids[0]] != "F" and incoming_source is None:
        raise ValueError(
            f"set_roles: layer {ids[0]} opens the stage, so it must stay F (an S layer needs an "
            f"earlier F layer on its own stage, or indices sent from the previous stage: incoming_source)."
        )
    for i in ids:
        if want[i] == "F" and stage.layers[str(i)].attn.indexer is None:
            raise ValueError(
                f"set_roles: layer {i} was built as S and has no indexer weights, so it cannot run as F. Build the "
                f"stage with every layer F (and an all-F checkpoint) to switch roles freely."
            )
    last_f = ids[0] if incoming_source is None else incoming_source
    for i in ids:
        block = stage.layers[str(i)]
        if want[i] == "F":
            last_f = i
        source = i if want[i] == "F" else last_f
        block.role = block.attn.role = want[i]
        block.source = block.attn.source = source
    stage.incoming_source = incoming_source if want[ids[0]] == "S" else None
