"""An auxiliary loss carried by the main path: its gradient joins the backward of whatever consumes the output, so a
pipeline schedule that knows only the LM loss still trains it (the stage's indexer loss, a MoE balance loss)."""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    """out -> out (same storage); backward: grad_out passes through unchanged and the auxiliary scalar gets `weight`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_meta = (aux.dtype, aux.device)
        # An alias of `out`'s storage that is not an autograd view: the pipelining runtime detaches stage outputs
        # in place (`detach_()`), which views refuse, and a copy would cost a pass over the (possibly large) output.
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dtype, device = ctx.aux_meta
        return grad_out, torch.full((), ctx.weight, dtype=dtype, device=device), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """Return `out` unchanged in value; backpropagating through the result also backpropagates `weight * aux`.

    out: any tensor on the main path (the stage output); aux: a differentiable scalar whose graph is disjoint from
    `out`'s, or shares its inputs (the stage's indexer loss, a MoE layer's balance loss)."""
    return _AttachAuxLoss.apply(out, aux, float(weight))
