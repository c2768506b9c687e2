"""Mixture-of-experts MLPs: the DeepSeek-V3 / V3.2 and GLM-5 recipe, as `model.moe`.

A MoE layer's MLP is a router, `n_routed_experts` SwiGLU experts of width `moe_inter_dim` (each token runs
`num_experts_per_tok` of them) and one shared SwiGLU of width `n_shared_experts * moe_inter_dim` that every token
runs. Routing (dsaflow/model/moe.py): sigmoid scores from an fp32 gate; a per-expert bias that only *selects*
(auxiliary-loss-free balancing); group-limited top-k (the experts split into `n_group` groups, each ranked by the sum
of its two best biased scores, the best `topk_group` groups kept); the chosen experts' unbiased scores, normalised
to sum 1 when `norm_topk_prob`, times `routed_scaling_factor`. Layers `0 .. first_k_dense - 1` (or those listed in
`dense_layers`) keep the dense MLP of width `model.inter_dim`.

Field names follow the Hugging Face config.json of DeepSeek-V3.2 and GLM-5 where one exists: n_routed_experts,
num_experts_per_tok, n_shared_experts, n_group, topk_group, norm_topk_prob, routed_scaling_factor; moe_inter_dim is
`moe_intermediate_size` and first_k_dense is `first_k_dense_replace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from dsaflow.errors import ConfigError

from .fields import num


@dataclass
class MoEConfig:
    """These defaults are `model=tiny_moe`'s (8 experts, 2 per token, 1 shared)."""

    n_routed_experts: int = num(8, 1, 4096)
    num_experts_per_tok: int = num(2, 1, 4096)
    moe_inter_dim: int = num(64, 1, 1 << 20)
    n_shared_experts: int = num(1, 0, 64)  # 0 = no shared expert
    n_group: int = num(1, 1, 4096)
    topk_group: int = num(1, 1, 4096)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = num(1.0, 0, 1000, lo_open=True)
    first_k_dense: int = num(0, 0, 1024)
    # explicit dense layers (global indices) instead of the first `first_k_dense`; every other layer is MoE
    dense_layers: Optional[List[int]] = None
    # auxiliary-loss-free balancing: after each optimizer step every expert's selection bias moves by
    # rate * sign(mean load - its load), the loads summed over the step's microbatches (DeepSeek-V3: 0.001); 0 = off
    bias_update_rate: float = num(0.001, 0, 1)
    # weight of DeepSeek-V3's sequence-wise balance loss (sum over experts of f_i * P_i per sequence); 0 = off
    aux_loss_weight: float = num(0.0, 0, 1000)


def is_moe_layer(model_cfg, layer: int) -> bool:
    """Whether global layer `layer` of a model (a ModelConfig) has a MoE MLP."""
    moe = model_cfg.moe
    if moe is None:
        return False
    if moe.dense_layers is not None:
        return layer not in set(moe.dense_layers)
    return layer >= moe.first_k_dense


def check_moe(moe: MoEConfig, num_layers: int) -> None:
    """Cross-field rules of `model.moe` (ranges are `schema.validate`'s): raises ConfigError naming the field."""
    e, k, g, tg = moe.n_routed_experts, moe.num_experts_per_tok, moe.n_group, moe.topk_group
    if k > e:
        raise ConfigError(
            f"model.moe.num_experts_per_tok={k} is greater than model.moe.n_routed_experts={e}: a token cannot run "
            f"more experts than exist. Fix: set model.moe.num_experts_per_tok <= {e}."
        )
    if e % g:
        raise ConfigError(
            f"model.moe.n_routed_experts={e} is not divisible by model.moe.n_group={g}: the experts split into equal "
            f"groups. Fix: choose n_group among the divisors of {e}, e.g. model.moe.n_group=1."
        )
    if tg > g:
        raise ConfigError(
            f"model.moe.topk_group={tg} is greater than model.moe.n_group={g}: routing keeps topk_group of the "
            f"n_group groups. Fix: set model.moe.topk_group <= {g}."
        )
    if g > 1 and e // g < 2:
        raise ConfigError(
            f"model.moe.n_group={g} leaves {e // g} expert per group, but a group is ranked by its two best "
            f"scores. Fix: at most {e // 2} groups, e.g. model.moe.n_group=1."
        )
    if k > tg * (e // g):
        raise ConfigError(
            f"model.moe.num_experts_per_tok={k} exceeds the {tg * (e // g)} experts of the topk_group={tg} kept "
            f"groups. Fix: raise model.moe.topk_group or lower num_experts_per_tok."
        )
    if moe.first_k_dense > num_layers:
        raise ConfigError(
            f"model.moe.first_k_dense={moe.first_k_dense} is above model.num_layers={num_layers}. Fix: set "
            f"model.moe.first_k_dense <= {num_layers} (equal means every layer dense)."
        )
    if moe.dense_layers is not None:
        if moe.first_k_dense:
            raise ConfigError(
                f"model.moe.dense_layers={list(moe.dense_layers)} and model.moe.first_k_dense={moe.first_k_dense} "
                "both choose the dense layers. Fix: set one of them (model.moe.first_k_dense=0 or "
                "model.moe.dense_layers=null)."
            )
        bad = [i for i in moe.dense_layers if not (isinstance(i, int) and 0 <= i < num_layers)]
        if bad:
            raise ConfigError(
                f"model.moe.dense_layers={list(moe.dense_layers)} names layers {bad} outside 0..{num_layers - 1}. "
                f"Fix: list layer indices below model.num_layers={num_layers}."
            )
