"""fp32 references: the router and the routed experts, one token and one expert at a time (tests compare the fast
path against these)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_naive(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], gate [E, D], bias [E] -> (ids int64 [N, top_k] in descending biased score, weights fp32 [N, top_k]).

    Per token: sigmoid scores; groups ranked by the sum of their two best biased scores; the best `topk_group`
    groups' experts compete on biased score; the winners' weights are their unbiased scores (normalised to sum 1
    when `norm_topk_prob`) times `scaling`."""
    scores = torch.sigmoid(x.double() @ gate.double().t())
    E = gate.shape[0]
    size = E // n_group
    ids, weights = [], []
    for s in scores:
        biased = s + bias.double()
        group_rank = sorted(range(n_group), key=lambda g: -sum(sorted(biased[g * size : (g + 1) * size].tolist())[-2:]))
        allowed = [e for g in group_rank[:topk_group] for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:top_k]
        w = s[chosen]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        weights.append(w * scaling)
    return torch.tensor(ids, dtype=torch.long), torch.stack(weights).float()


def moe_experts_naive(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [N, D], ids int64 [N, k], weights [N, k], gate_up [E, 2I, D], down [E, D, I] -> [N, D] fp32:
    sum over a token's experts of weight * down_e(silu(gate_e x) * up_e x), one expert at a time."""
    x, weights, gate_up, down = x.float(), weights.float(), gate_up.float(), down.float()
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        g, u = (x[token] @ gate_up[e].t()).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ down[e].t()
        out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
    return out
