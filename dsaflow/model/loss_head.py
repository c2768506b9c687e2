"""The last stage's loss head in token chunks: final RMSNorm, LM head and cross-entropy without [tokens, vocab] logits.

At long context the logits dominate the last stage: 256K tokens x a 154,880-word vocabulary is 151 GiB in fp32 for one
microbatch. `chunked_lm_loss` runs norm + head + cross-entropy over `chunk_tokens` rows at a time. The forward keeps
only each token's log-sum-exp ([N] fp32) besides its inputs; the backward recomputes one chunk's logits at a time,
turns them into dlogits = softmax - onehot from the saved log-sum-exp, and sums the head's weight gradient over the
chunks in fp32. So the largest transient is one chunk's logits, [chunk_tokens, vocab], a few times over (fp32 logits,
their gradient, the compute-dtype copies). The head's matmuls run once more than in an unchunked backward (the
recomputed forward), the price of never holding the logits.

Numerics follow `F.cross_entropy(head(norm(h)).float())` under the caller's autocast: the head's matmul runs in the
autocast dtype (bf16 on GPU) with fp32 logits, the rest in fp32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from dsaflow.ops.rmsnorm import rms_norm

IGNORE_INDEX = -100


def compute_dtype(device: torch.device, fallback: torch.dtype) -> torch.dtype:
    """The dtype a Linear runs in here: the autocast dtype when autocast is on for `device`, else `fallback`."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return fallback


class ChunkedLMLoss(torch.autograd.Function):
    """(hidden [N, D], norm_weight [D] or None (hidden is already normed), head_weight [V, D], target [N] int64) ->
    (loss sum over the non-ignored targets (fp32 scalar), argmax [N] int64 of the logits, or an empty tensor when not
    asked for)."""

    @staticmethod
    def forward(ctx, hidden, norm_weight, head_weight, target, chunk_tokens, eps, dtype, want_argmax):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(hidden.shape[0] if want_argmax else 0, dtype=torch.long, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = head_weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, hidden.shape[0], chunk_tokens):
                hi = min(lo + chunk_tokens, hidden.shape[0])
                logits = _chunk_logits(hidden[lo:hi], norm_weight, w, eps)
                lse[lo:hi] = torch.logsumexp(logits, dim=-1)
                total += _chunk_nll(logits, lse[lo:hi], target[lo:hi]).sum()
                if want_argmax:
                    argmax[lo:hi] = logits.argmax(dim=-1)
                del logits
        ctx.save_for_backward(hidden, norm_weight, head_weight, target, lse)
        ctx.chunk_tokens, ctx.eps, ctx.dtype = chunk_tokens, eps, dtype
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total, _grad_argmax):
        hidden, norm_weight, head_weight, target, lse = ctx.saved_tensors
        d_hidden = torch.empty_like(hidden)
        normed_in = norm_weight is None  # hidden is what the head reads: no norm to differentiate through
        d_norm = None if normed_in else torch.zeros(norm_weight.shape, dtype=torch.float32, device=hidden.device)
        d_head = torch.zeros(head_weight.shape, dtype=torch.float32, device=hidden.device)
        w = head_weight.to(ctx.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, hidden.shape[0], ctx.chunk_tokens):
                hi = min(lo + ctx.chunk_tokens, hidden.shape[0])
                if normed_in:
                    normed = hidden[lo:hi]
                else:
                    with torch.enable_grad():
                        h = hidden[lo:hi].detach().requires_grad_()
                        nw = norm_weight.detach().requires_grad_()
                        normed = rms_norm(h, nw, ctx.eps)
                n_c = normed.detach().to(ctx.dtype)
                logits = (n_c @ w.t()).float()
                d_logits = _softmax_minus_onehot(logits, lse[lo:hi], target[lo:hi], grad_total).to(ctx.dtype)
                del logits
                d_head += (d_logits.t() @ n_c).float()
                d_normed = (d_logits @ w).to(normed.dtype)
                if normed_in:
                    d_hidden[lo:hi] = d_normed
                    continue
                d_h, d_nw = torch.autograd.grad(normed, (h, nw), d_normed)
                d_hidden[lo:hi] = d_h
                d_norm += d_nw.float()
        d_norm = None if normed_in else d_norm.to(norm_weight.dtype)
        return d_hidden, d_norm, d_head.to(head_weight.dtype), None, None, None, None, None


def _chunk_logits(h: torch.Tensor, norm_weight: Optional[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """h [n, D] -> fp32 logits [n, V]: the head's matmul in w's dtype (norm_weight None: h is already normed)."""
    normed = h if norm_weight is None else rms_norm(h, norm_weight, eps)
    return (normed.to(w.dtype) @ w.t()).float()


def _chunk_nll(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[n] negative log-likelihood of each target, 0 where it is IGNORE_INDEX."""
    keep = target != IGNORE_INDEX
    picked = logits.gather(1, torch.where(keep, target, 0).unsqueeze(1)).squeeze(1)
    return torch.where(keep, lse - picked, 0.0)


def _softmax_minus_onehot(logits, lse, target, scale) -> torch.Tensor:
    """d(sum of the chunk's NLL)/d logits times `scale`: softmax - onehot(target), zero rows for ignored targets.
    Overwrites `logits` (the chunk's only copy)."""
    keep = target != IGNORE_INDEX
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, torch.where(keep, target, 0).unsqueeze(1), -keep.to(probs.dtype).unsqueeze(1))
    return probs.mul_((keep.to(probs.dtype) * scale).unsqueeze(1))


def chunked_lm_loss(
    hidden: torch.Tensor,
    norm_weight: Optional[torch.Tensor],
    head_weight: torch.Tensor,
    target: torch.Tensor,
    chunk_tokens: int,
    eps: float,
    want_argmax: bool = False,
    reduction: str = "mean",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Mean cross-entropy of `head(rms_norm(hidden))` against `target`, `chunk_tokens` rows at a time.

    Args:
        hidden: [..., D] the last layer's output (before the final norm).
        norm_weight: [D] the final RMSNorm's weight, or None when hidden is already normed (an MTP depth's output,
            `MTPLayer.predict`): then the head reads hidden itself. head_weight: [V, D] the LM head's.
        target: [...] int64 next-token ids, IGNORE_INDEX (-100) = no loss.
        chunk_tokens: rows per chunk (>= 1).
        eps: the final norm's epsilon.
        want_argmax: also return the argmax of each row's logits (accuracy counters).
        reduction: "mean" over the non-ignored targets, or their "sum" (a context-parallel shard, whose share of
            the targets may be empty, divides by the count of the whole sequence itself).

    Returns:
        (loss, argmax): the fp32 mean over the non-ignored targets (NaN when every target is ignored, as
        F.cross_entropy) or their sum, differentiable in hidden and both weights; argmax [...] int64 or None.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum'.")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: need at least one row per chunk.")
    lead = hidden.shape[:-1]
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    dtype = compute_dtype(hidden.device, head_weight.dtype)
    total, argmax = ChunkedLMLoss.apply(flat_h, norm_weight, head_weight, flat_t, chunk_tokens, eps, dtype, want_argmax)
    argmax = argmax.view(lead) if want_argmax else None
    if reduction == "sum":
        return total, argmax
    return total / (flat_t != IGNORE_INDEX).sum(), argmax
