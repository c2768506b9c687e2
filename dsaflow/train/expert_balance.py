"""Auxiliary-loss-free expert balancing across a rank's stages, and the expert-load metrics.

During a step, every training microbatch forward adds its routed-token counts to its MoE layers' `expert_load`
(`TrainContext.record_expert_load`, set by `TrainStage` for real microbatches only). After the optimizer step each
layer's selection bias moves by `model.moe.bias_update_rate * sign(mean load - load)` over the whole step's counts
(DeepSeek-V3), and the counts clear. The load balance of the step, max / mean and min / mean per MoE layer, rides
the step's one metrics all-reduce: no extra host sync.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from dsaflow.model import MoE, expert_load_balance, moe_layers, update_expert_bias


class ExpertBalance:
    """The MoE layers of this rank's stage modules (keyed by global layer index) and the model's layer count."""

    def __init__(self, modules: Sequence[nn.Module], num_layers: int, rate: float):
        self.num_layers, self.rate = num_layers, rate
        self.layers: List[Tuple[int, MoE]] = []
        for m in modules:
            for name, layer in moe_layers(m).items():
                self.layers.append((int(name.split(".")[1]), layer))  # "layers.<i>.mlp"

    def width(self) -> int:
        """Entries this adds to the step's metrics vector: (max / mean, min / mean) per model layer."""
        return 2 * self.num_layers

    def after_step(self, out: torch.Tensor, update: bool) -> None:
        """Write this rank's layers' load balance into `out` [2 * num_layers] (zeros elsewhere, so a sum over ranks
        assembles the model), then, with `update` (the main optimizer stepped), move the biases; clear the counts."""
        for i, layer in self.layers:
            out[2 * i : 2 * i + 2] = expert_load_balance(layer).to(out.dtype)
            if update and self.rate > 0:
                update_expert_bias(layer, self.rate)
            else:
                layer.gate.expert_load.zero_()

    def metrics(self, reduced: torch.Tensor, moe_layer_ids: Sequence[int]) -> Dict[str, float]:
        """Per MoE layer `layer<i>_expert_load_max` / `_min` (over the mean), and the worst of each over layers.
        reduced: the summed vector `after_step` filled on every rank. A step that routed no token (the dense
        warm-up trains only the indexers) reports nothing."""
        values = reduced.view(-1, 2).tolist()
        moe_layer_ids = [i for i in moe_layer_ids if math.isfinite(values[i][0])]
        if not moe_layer_ids:
            return {}
        out: Dict[str, float] = {}
        for i in moe_layer_ids:
            out[f"layer{i}_expert_load_max"], out[f"layer{i}_expert_load_min"] = values[i]
        out["expert_load_max"] = max(values[i][0] for i in moe_layer_ids)
        out["expert_load_min"] = min(values[i][1] for i in moe_layer_ids)
        return out
