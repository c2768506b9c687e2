"""`IndexerKLFunction`: the differentiable sparse indexer KL through the Triton kernels (`triton_kl.py`)."""

from __future__ import annotations

import torch

from .triton_kl import launch_indexer_kl_bwd, launch_indexer_kl_fwd


class IndexerKLFunction(torch.autograd.Function):
    """Differentiable in q_I, k_I, w; indices and the target are constants."""

    @staticmethod
    def forward(ctx, q, k, w, indices, target, overrides):
        stats = launch_indexer_kl_fwd(q, k, w, indices, target, overrides)
        n_valid = stats[3].sum().clamp_min(1.0)
        ctx.save_for_backward(q, k, w, indices, target, stats, n_valid)
        ctx.overrides = overrides
        return stats[0].sum() / n_valid

    @staticmethod
    def backward(ctx, grad):
        q, k, w, indices, target, stats, n_valid = ctx.saved_tensors
        g = (grad.float() / n_valid).reshape(1)
        dq, dk, dw = launch_indexer_kl_bwd(q, k, w, indices, target, stats, g, ctx.overrides)
        return dq, dk, dw, None, None, None


def indexer_kl_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    overrides: dict | None = None,
) -> torch.Tensor:
    """Same contract as `dsaflow.ops.indexer_loss.indexer_kl` (CUDA or the Triton interpreter)."""
    if k.dtype != q.dtype:
        raise ValueError(f"indexer_kl: q_I.dtype={q.dtype} != k_I.dtype={k.dtype} (the kernels dot them)")
    B, T, H, D = q.shape
    if H > 128 or D > 256:
        raise ValueError(
            f"indexer_kl: H_I={H}, D_I={D}: the kernels hold all heads of a query in one tile (H_I <= 128, D_I <= 256)"
        )
    if B * T == 0:  # no query: the mean over valid queries is 0 (kept differentiable)
        return (q.sum() + k.sum() + w.sum()).float() * 0.0
    q, k, w = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, w))
    indices = indices.to(torch.int32)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    target = target.float()
    target = target if target.stride(-1) == 1 else target.contiguous()
    return IndexerKLFunction.apply(q, k, w, indices, target, overrides)
