"""Routed experts of a MoE layer: sort the (token, expert) pairs by expert, two grouped GEMMs, unsort, weigh, sum.

Static shapes throughout (N x top_k rows whatever the routing) and offsets computed on the device, so nothing syncs
the host and serving graphs capture the layer. The grouped GEMM's kernel is `dispatch.py`'s choice; `naive.py` holds
the fp32 references.
"""

from __future__ import annotations

import torch

from ..fp8_gemm import Fp8Activation, fp8_grouped_mm
from ..kernel_table import chosen, describe
from .dispatch import explain_grouped_mm
from .function import ExpandSorted, GroupedMM, PermuteRows, SwigluWeighted, UnsortSum
from .naive import moe_experts_naive, route_naive


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of a routing, grouped by expert, on the device.

    Args:
        ids: int64 [N, k] each token's experts.
        num_experts: E.

    Returns:
        order: int64 [N * k] the flat pair indices (token * k + slot) sorted by expert, stable.
        offsets: int32 [E] where each expert's rows end in that order (cumulative; offsets[-1] = N * k).
    """
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row times its expert's weight, transposed.

    Args:
        a: [M, K] rows sorted by expert.
        w: [E, N, K] one weight per expert, a's dtype.
        offsets: int32 [E] where each expert's rows end (`sort_by_expert`).

    Returns:
        [M, N] in a's dtype, row m = a[m] @ w[e(m)]^T (fp32 accumulation); differentiable in a and w. A call no
        kernel takes raises ValueError with each kernel's reason (`explain_grouped_mm`).
    """
    kernel = chosen("grouped_mm", explain_grouped_mm(a, w), describe(a=a, w=w))
    return GroupedMM.apply(a, w, offsets, kernel)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_fp8: Fp8Activation | None = None,
) -> torch.Tensor:
    """The routed experts' output.

    Args:
        x: [N, D] token activations (the compute dtype; gate_up and down must share it).
        ids: int64 [N, k] each token's experts (from the router).
        weights: [N, k] each chosen expert's gate weight (fp32 from the router).
        gate_up: [E, 2I, D] each expert's gate (first I rows) and up projections.
        down: [E, D, I] each expert's down projection.
        scales: FP8 experts (serve.weights=fp8): gate_up and down are float8_e4m3fn and these are their fp32 block
            scales ([E, ceil(2I/128), ceil(D/128)], [E, ceil(D/128), ceil(I/128)]); both GEMMs run through
            `fp8_grouped_mm` (inference: no gradient reaches the FP8 weights). None: x's dtype, `grouped_mm`.
        x_fp8: with FP8 experts, x already quantized (`quantize_activation(x)`, shared with the layer's other FP8
            GEMMs on x); the gate/up GEMM reads its rows instead of quantizing x. None: quantized here.

    Returns:
        [N, D] in x's dtype: sum over slots j of weights[:, j] * down_e(silu(gate_e x) * up_e x), e = ids[:, j].
        Differentiable in x, weights, gate_up and down (in x and weights with FP8 experts).
    """
    N, k = ids.shape
    order, offsets = sort_by_expert(ids, gate_up.shape[0])
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    row_weights = PermuteRows.apply(weights.reshape(-1), order, inverse)  # [N * k], in the rows' order

    # the routing weight scales the [N * k, I] activation, not the [N * k, D] output: fewer bytes, one fused pass
    def gemm(a: torch.Tensor, w: torch.Tensor, scale) -> torch.Tensor:
        return grouped_mm(a, w, offsets) if scale is None else fp8_grouped_mm(a, w, scale, offsets)

    gate_up_scale, down_scale = (None, None) if scales is None else scales
    if x_fp8 is not None and x_fp8.rows != N:
        raise ValueError(f"moe_experts: x_fp8 holds {x_fp8.rows} rows, x {N}: pass the quantization of this x")
    if gate_up_scale is not None and not (torch.is_grad_enabled() and x.requires_grad):
        # FP8 without a gradient to x: quantize the N tokens once and gather their e4m3 rows, not k copies of x
        h = fp8_grouped_mm(x if x_fp8 is None else x_fp8, gate_up, gate_up_scale, offsets, gather=order // k)
    else:
        if x_fp8 is not None:
            raise ValueError("moe_experts: x_fp8 is for FP8 experts without a gradient to x; pass x alone")
        h = gemm(ExpandSorted.apply(x, order, inverse, k), gate_up, gate_up_scale)  # each token once per expert
    act = SwigluWeighted.apply(h, row_weights)
    out = gemm(act, down, down_scale)  # [N * k, D], still sorted by expert
    return UnsortSum.apply(out, order, inverse, k)


__all__ = [
    "explain_grouped_mm",
    "grouped_mm",
    "moe_experts",
    "moe_experts_naive",
    "route_naive",
    "sort_by_expert",
]
