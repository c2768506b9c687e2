"""`GroupedMM`: the differentiable grouped GEMM y[m] = a[m] @ w[e(m)]^T over rows sorted by expert, forward and
backward on the kernel `dispatch.py` chose."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _torch_rows(a, b, offsets):
    return F.grouped_mm(a, b, offs=offsets)


def _torch_weight_grad(a, b, offsets):
    return F.grouped_mm(a.t(), b, offs=offsets)


def kernel_forms(kernel: str):
    """kernel -> (rows form: a [M, K] @ b[e] with b [E, K, N]; weight-gradient form: a[rows_e]^T @ b[rows_e])."""
    if kernel == "torch_grouped":
        return _torch_rows, _torch_weight_grad
    from .triton_grouped import grouped_mm_rows, grouped_mm_weight_grad  # Triton only where a kernel needs it

    return grouped_mm_rows, grouped_mm_weight_grad


class GroupedMM(torch.autograd.Function):
    """a [M, K] (rows sorted by expert), w [E, N, K], offsets int32 [E] (row ends) -> [M, N] in a's dtype.
    Differentiable in a and w; a and w must share a dtype."""

    @staticmethod
    def forward(ctx, a, w, offsets, kernel: str):
        rows, _ = kernel_forms(kernel)
        ctx.save_for_backward(a, w, offsets)
        ctx.kernel = kernel
        return rows(a, w.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad):
        a, w, offsets = ctx.saved_tensors
        rows, weight_grad = kernel_forms(ctx.kernel)
        grad = grad.contiguous()  # a reduction's gradient arrives expanded (stride 0), which the kernels refuse
        grad_a = rows(grad, w, offsets) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(grad, a, offsets) if ctx.needs_input_grad[1] else None
        return grad_a, grad_w, None, None


class ExpandSorted(torch.autograd.Function):
    """x [N, D] -> rows [N * k, D] with rows[i] = x[order[i] // k]: each token once per chosen expert, in expert
    order. The backward sums each token's k row gradients through the inverse permutation (a gather and a sum:
    no atomics, deterministic)."""

    @staticmethod
    def forward(ctx, x, order, inverse, k: int):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1]).sum(dim=1)
        return grad_x, None, None, None


class PermuteRows(torch.autograd.Function):
    """x [M, D] -> x[perm] for a permutation `perm` whose inverse is `inverse`; the backward gathers the gradient
    through the inverse (no scatter)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _swiglu_weighted_reference(h, w):
    gate, up = h.float().chunk(2, dim=-1)
    return F.silu(gate) * up * w.float().unsqueeze(-1)


class SwigluWeighted(torch.autograd.Function):
    """h [M, 2I] = [gate | up], w [M] fp32 -> w * silu(gate) * up [M, I] in h's dtype, fp32 inside. CUDA tensors run
    `triton_swiglu.py` (one pass forward, one backward), CPU tensors the torch expression."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        if h.is_cuda:
            from .triton_swiglu import swiglu_weighted_fwd

            return swiglu_weighted_fwd(h.contiguous(), w.float().contiguous())
        return _swiglu_weighted_reference(h, w).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        if h.is_cuda:
            from .triton_swiglu import swiglu_weighted_bwd

            dh, dw = swiglu_weighted_bwd(h.contiguous(), w.float().contiguous(), grad.contiguous())
            return dh, dw.to(w.dtype)
        with torch.enable_grad():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            dh, dw = torch.autograd.grad(_swiglu_weighted_reference(hh, ww), (hh, ww), grad.float())
        return dh.to(h.dtype), dw.to(w.dtype)


class UnsortSum(torch.autograd.Function):
    """out [N * k, D] rows sorted by expert -> [N, D], each token's k rows summed (row r of token t is
    out[inverse[t * k + j]]); CUDA tensors in one Triton pass with fp32 sums (`triton_unsort.py`). The backward
    hands each sorted row its token's gradient, one gather of [N * k, D] with no [N, k, D] intermediate."""

    @staticmethod
    def forward(ctx, out, order, inverse, k: int):
        ctx.save_for_backward(order)
        ctx.k = k
        if out.is_cuda:  # one pass (`triton_unsort.py`): no [N * k, D] copy in token order
            from .triton_unsort import unsort_sum_triton

            return unsort_sum_triton(out.contiguous(), inverse, k)
        return out.index_select(0, inverse).view(-1, k, out.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, order // ctx.k), None, None, None
