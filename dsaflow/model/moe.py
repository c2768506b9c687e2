"""A mixture-of-experts MLP (DeepSeek-V3 / V3.2, GLM-5): fp32 router, routed SwiGLU experts, shared experts.

Routing (`Router`): sigmoid scores of an fp32 gate; `e_score_correction_bias` is added only to *select* experts
(auxiliary-loss-free balancing), group-limited (groups ranked by the sum of their two best biased scores, the best
`topk_group` kept); the weights are the chosen experts' unbiased scores, normalised when `norm_topk_prob`, times
`routed_scaling_factor`. The experts run through `dsaflow.ops.moe.moe_experts` (sorted rows, grouped GEMMs, no host
sync). State-dict names follow transformers' DeepSeek-V3.2 modules: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I],
`mlp.shared_experts.{w1,w2,w3}`.

Balancing state: a training forward that asks for it (`count_load`, from `TrainContext.record_expert_load`) adds each expert's token
count to the router's non-persistent buffer `expert_load`; `update_expert_bias` (after the optimizer step) moves the bias by
rate * sign(mean load - load) and clears the counts. With `aux_loss_weight > 0` the sequence-wise balance loss is
attached to the layer's output (`attach_aux_loss`), so the pipeline schedule still carries only the LM loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.ops.fp8_gemm import shared_fp8_input
from dsaflow.ops.moe import moe_experts

from .aux_loss import attach_aux_loss
from .swiglu import SwiGLU


class Router(nn.Module):
    """x [N, D] -> (ids int64 [N, k], weights fp32 [N, k], scores fp32 [N, E]). The gate and the bias stay fp32 under
    any `.to(dtype)` of the model (routing decisions are sensitive to rounding: DeepSeek-V3 routes in fp32)."""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, dim, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_routed_experts, dtype=torch.float32))
        # tokens routed to each expert since the last bias update (training forwards that record it); fp32 counts
        self.register_buffer("expert_load", torch.zeros(moe.n_routed_experts, dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out.float() if out.is_floating_point() else out

        return super()._apply(keep_fp32, recurse)

    def forward(self, x: torch.Tensor):
        m = self.moe
        scores = torch.sigmoid(F.linear(x.float(), self.weight))  # [N, E]
        biased = scores.detach() + self.e_score_correction_bias  # selection only: no gradient through the choice
        if m.n_group > 1:
            N, E = biased.shape
            grouped = biased.view(N, m.n_group, E // m.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            kept = group_score.topk(m.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)
        ids = biased.topk(m.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * m.routed_scaling_factor, scores


class Experts(nn.Module):
    """The routed experts' weights, packed: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I].
    (`dsaflow.model.fp8_weights.FP8Experts` is the same with e4m3 weights and block scales.)"""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        e, i = moe.n_routed_experts, moe.moe_inter_dim
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, dim))
        self.down_proj = nn.Parameter(torch.empty(e, dim, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D], ids int64 [N, k], weights fp32 [N, k] -> [N, D] in the compute dtype."""
        # the weights in the compute dtype, as autocast would cast a Linear's (gradients flow back through)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return moe_experts(x.to(dtype), ids, weights, self.gate_up_proj.to(dtype), self.down_proj.to(dtype))


class MoE(nn.Module):
    """x [B, T, D] -> [B, T, D]: routed experts plus shared experts."""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = Router(dim, moe)
        self.experts = Experts(dim, moe)
        shared = moe.n_shared_experts * moe.moe_inter_dim
        self.shared_experts = SwiGLU(dim, shared) if shared else None

    def _reads_x(self) -> list[torch.Tensor]:
        """The weights of the GEMMs whose input is the layer's x: the routed experts' gate/up projection and the
        shared experts' w1 and w3."""
        shared = self.shared_experts
        return [self.experts.gate_up_proj, *(() if shared is None else (shared.w1.weight, shared.w3.weight))]

    def forward(
        self, x: torch.Tensor, count_load: bool = False, balance_loss: bool = False, real: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """count_load: add each expert's routed tokens to `gate.expert_load` (a training forward, once: not in a
        block's recomputation); balance_loss: attach the sequence-wise balance loss when its weight is > 0 (every
        run of a training forward, so a recomputation saves what the first run saved); real: bool [B, T], the
        tokens that count (False = padding; default all)."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        ids, weights, scores = self.gate(flat)
        # FP8 experts: the routed and the shared experts' GEMMs read one quantization of x
        x_fp8 = shared_fp8_input(x, *self._reads_x())
        if x_fp8 is None:
            out = self.experts(flat, ids, weights).view(B, T, D)
        else:
            out = self.experts(flat, ids, weights, x_fp8).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, x_fp8)
        if not (count_load or balance_loss):  # serving and evaluation: nothing to count
            return out
        real = torch.ones(B, T, dtype=torch.bool, device=x.device) if real is None else real
        if count_load:
            with torch.no_grad():  # padding queries route too, but are no load
                self.gate.expert_load.scatter_add_(
                    0, ids.reshape(-1), real.reshape(-1, 1).expand_as(ids).reshape(-1).float()
                )
        if balance_loss and self.moe.aux_loss_weight > 0:
            aux = sequence_balance_loss(scores.view(B, T, -1), ids.view(B, T, -1), real)
            out = attach_aux_loss(out, aux, self.moe.aux_loss_weight)
        return out


def sequence_balance_loss(scores: torch.Tensor, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences: sum_i f_i * P_i with
    f_i = E / (k T) * (tokens routed to expert i), P_i = mean over tokens of expert i's normalised score.
    scores fp32 [B, T, E], ids [B, T, k], real bool [B, T] (padding excluded) -> scalar."""
    B, T, E = scores.shape
    k = ids.shape[-1]
    mask = real.unsqueeze(-1).float()
    tokens = mask.sum(dim=1).clamp(min=1)  # [B, 1]
    hits = torch.zeros(B, T, E, device=scores.device).scatter_(2, ids, 1.0) * mask
    f = hits.sum(dim=1) * E / (k * tokens)  # [B, E], no gradient (a count)
    p = (scores / scores.sum(dim=-1, keepdim=True) * mask).sum(dim=1) / tokens  # [B, E]
    return (f * p).sum(dim=-1).mean()


@torch.no_grad()
def update_expert_bias(moe: MoE, rate: float) -> None:
    """After an optimizer step: bias += rate * sign(mean load - load) over the counts since the last update, then
    clear the counts. On the device, no host sync."""
    load = moe.gate.expert_load
    moe.gate.e_score_correction_bias.add_(torch.sign(load.mean() - load), alpha=rate)
    load.zero_()


@torch.no_grad()
def expert_load_balance(moe: MoE) -> torch.Tensor:
    """fp32 [2]: (max / mean, min / mean) of the expert load counted since the last bias update (NaN when nothing
    was counted). On the device: the caller syncs when it logs."""
    load = moe.gate.expert_load
    mean = load.mean()
    return torch.stack([load.max(), load.min()]) / mean


def moe_layers(module: nn.Module) -> dict[str, MoE]:
    """name -> MoE for every MoE MLP under `module` (a stage or a whole model), in registration order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, MoE)}
