"""CUDA entry of `sparse_mla`: picks the prefill or decode path and wraps the kernels in autograd.

- grad needed (grad mode on and q or kv requires grad): `SparseMLATriton` (prefill forward + Triton backward; the
  backward is deterministic when `determinism.is_deterministic()` holds at backward time).
- no grad: the Hopper prefill forward when its grid covers at least half the GPU (`no_grad_takes_hopper_forward`);
  else, for 16 heads per query (a TP-8 shard of V3.2's 128) on sm_90, the warp-specialised Gluon decode
  (`hopper_decode.py`, `select_decode`); else the split-K decode launcher, which uses one split (= the prefill
  kernel) when the grid already fills the GPU and several when B * T is small.
- the prefill forward (grad, or the no-grad case above) is the warp-specialised Gluon kernel (`hopper_prefill.py`)
  where `select_forward` says so: an sm_90 GPU, DeepSeek MLA shapes and triton 3.6's Gluon; else the portable Triton
  kernel. `DSAFLOW_SPARSE_MLA_FWD=triton|hopper` forces one (hopper raises with the reason where it cannot run).
- shapes the kernels cannot take (see `kernel_supports`) raise `ValueError` naming the shape and the reason: no
  silent slow path. Empty inputs (no query, key or kv row) launch nothing and return the reference's result.
All CUDA paths are graph-safe: grids and buffers depend on shapes only, and invalid indices are masked in-kernel.
Every kernel stops each query's key loop at its key extent (`triton_prefill.key_extent`: 1 + the last valid slot,
from a small kernel, no host sync); the autograd path computes it once and keeps it for the backward.
"""
from __future__ import annotations

import os
import warnings

import torch

from .determinism import is_deterministic
from .hopper_decode import DECODE_BLOCK_H, hopper_decode_supports, sparse_mla_decode_hopper
from .hopper_prefill import _gluon_ok, _shape_reason, hopper_fwd_supports, sparse_mla_fwd_hopper
from .naive import sparse_mla_naive
from .triton_backward import sparse_mla_bwd_triton
from .triton_decode import choose_num_splits, sparse_mla_decode_triton
from .triton_prefill import fwd_config, key_extent, sparse_mla_fwd_triton

FORWARD_KERNELS = ("auto", "triton", "hopper")
_WARNED_NO_GLUON: set = set()

MAX_D_V = 512  # the fp32 accumulator [64, 512] is the most two warpgroups' registers hold
MAX_D_TAIL = 128
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if the Triton kernels take these shapes, else the reason they do not (`sparse_mla_triton` raises it)."""
    d_qk = q.shape[-1]
    if q.dtype not in _DTYPES or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (kernels take bf16/fp16/fp32 with q.dtype == kv.dtype)"
    if not 0 < d_v <= MAX_D_V or not 0 <= d_qk - d_v <= MAX_D_TAIL:
        return f"d_v={d_v}, d_qk={d_qk} (kernels take 0 < d_v <= {MAX_D_V} and 0 <= d_qk - d_v <= {MAX_D_TAIL})"
    if q.dtype == torch.float32 and d_qk > 256:
        return f"fp32 with d_qk={d_qk} > 256 (the fp32 tiles do not fit in shared memory; use bf16)"
    return None


def _is_empty(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    return kv.shape[1] == 0 or indices.shape[-1] == 0 or q.shape[0] * q.shape[1] * q.shape[2] == 0


def _empty_result(q, kv, indices, sm_scale, d_v):
    """No query, no key slot or no kv row: out = 0, lse = -inf (every query has no key), through the reference so
    that gradients (zero) still reach q and kv."""
    B, T, H = q.shape[:3]
    if B * T * H == 0:
        out = q.new_zeros(B, T, H, d_v) + q.sum() * 0 + kv.sum() * 0
        return out, torch.full((B, T, H), float("-inf"), device=q.device)
    return sparse_mla_naive(q, kv, indices[..., :0], sm_scale, d_v)


def select_forward(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str:
    """"hopper" or "triton": which prefill forward runs these inputs (a function of shapes, dtypes and the device,
    so the choice is fixed for a captured graph)."""
    want = os.environ.get("DSAFLOW_SPARSE_MLA_FWD", "auto")
    if want not in FORWARD_KERNELS:
        raise ValueError(f"DSAFLOW_SPARSE_MLA_FWD={want!r}: use one of {', '.join(FORWARD_KERNELS)}.")
    if want == "triton":
        return "triton"
    reason = hopper_fwd_supports(q, kv, indices, d_v)
    if want == "hopper" and reason is not None:
        raise ValueError(f"DSAFLOW_SPARSE_MLA_FWD=hopper, but the Gluon kernel cannot run these inputs: {reason}")
    if reason is not None and _shape_reason(q, kv, indices, d_v) is None and "compute capability" not in reason:
        # A Hopper GPU and DeepSeek shapes, but this triton's Gluon is not the one the kernel is written for: the
        # portable kernel runs, about 1.7x slower at V3.2 shapes. Say so once.
        if reason not in _WARNED_NO_GLUON:
            _WARNED_NO_GLUON.add(reason)
            warnings.warn(f"sparse_mla: the Hopper forward kernel is unavailable ({reason}); using the portable "
                          f"Triton forward.", stacklevel=3)
    return "hopper" if reason is None else "triton"


def select_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str:
    """"hopper" or "triton": which kernel runs a no-grad call that the Hopper prefill forward does not take
    (shape-only, fixed for a captured graph). The Gluon decode serves exactly 16 heads per query, where it measured
    85 % of the copy rate on an H200 against the split-K kernel's 70 % (docs/kernels.md); with more heads its one
    program per 16-head block would gather each row once per block. `DSAFLOW_SPARSE_MLA_FWD=triton` keeps the
    portable kernel."""
    if os.environ.get("DSAFLOW_SPARSE_MLA_FWD", "auto") == "triton" or q.shape[2] != DECODE_BLOCK_H:
        return "triton"
    reason = hopper_decode_supports(q, kv, indices, d_v)
    if reason is not None and reason == _gluon_ok() and reason not in _WARNED_NO_GLUON:
        _WARNED_NO_GLUON.add(reason)  # sm_90 and a 16-head shard, but not the Gluon the kernel is written for
        warnings.warn(f"sparse_mla: the Hopper decode kernel is unavailable ({reason}); using the portable split-K "
                      f"decode.", stacklevel=3)
    return "hopper" if reason is None else "triton"


def no_grad_takes_hopper_forward(q: torch.Tensor, indices: torch.Tensor, d_v: int) -> bool:
    """Without grad, the Hopper forward (one program per query and 64-head block, whole key range) runs when its
    grid covers at least half the SMs, i.e. where the split-K kernel would take at most 2 splits; below that the
    split-K kernel's extra programs win. Shape-only. H200, 128 heads, 32K cache, topk 2048
    (`scripts/bench_hopper.py --part decode`): 32 seqs 0.086 vs 0.104 ms, 64 seqs 0.122 vs 0.181, 128 seqs 0.166
    vs 0.346; 16 seqs 0.083 vs 0.064 (split-K, 4 splits, faster)."""
    cfg = fwd_config(q, d_v, q.shape[-1] - d_v, indices.shape[2])
    return choose_num_splits(q, indices.shape[2], cfg["BLOCK_H"], cfg["BLOCK_K"]) <= 2


def prefill_forward(q, kv, indices, sm_scale: float, d_v: int, n_keys=None):
    if select_forward(q, kv, indices, d_v) == "hopper":
        return sparse_mla_fwd_hopper(q, kv, indices, sm_scale, d_v, n_keys=n_keys)
    return sparse_mla_fwd_triton(q, kv, indices, sm_scale, d_v, n_keys=n_keys)


class SparseMLATriton(torch.autograd.Function):
    """Differentiable in q and kv (and through lse); indices are integer inputs without gradient."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale: float, d_v: int, probs_into=None):
        # each query's key extent (1 + its last valid slot), computed once for the forward and the backward
        n_keys = key_extent(indices, kv.shape[1])
        out, lse = prefill_forward(q, kv, indices, sm_scale, d_v, n_keys)
        ctx.save_for_backward(q, kv, indices, out, lse, n_keys)
        # an output buffer the backward adds into (not saved: autograd must not version-check it)
        ctx.sm_scale, ctx.d_v, ctx.probs_into = sm_scale, d_v, probs_into
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, indices, out, lse, n_keys = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dkv = sparse_mla_bwd_triton(q, kv, indices, out, lse, d_out, d_lse, ctx.sm_scale, ctx.d_v,
                                        deterministic=is_deterministic(), n_keys=n_keys, probs_into=ctx.probs_into)
        return dq, dkv, None, None, None, None


def sparse_mla_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, probs_into=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `dsaflow.ops.sparse_mla.sparse_mla` (q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K];
    probs_into is handed to the backward, so the caller must need grad). Raises ValueError for shapes the kernels
    refuse (`kernel_supports`)."""
    if _is_empty(q, kv, indices):  # nothing to launch
        return _empty_result(q, kv, indices, sm_scale, d_v)
    reason = kernel_supports(q, kv, indices, d_v)
    if reason is not None:
        raise ValueError(
            f"sparse_mla on CUDA: the Triton kernels do not take q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} "
            f"{kv.dtype}, indices {tuple(indices.shape)}, d_v={d_v}: {reason}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad):
        return SparseMLATriton.apply(q, kv, indices, float(sm_scale), int(d_v), probs_into)
    if probs_into is not None:
        raise ValueError("sparse_mla_triton: probs_into is filled by the backward, but this call has no gradient")
    if select_forward(q, kv, indices, d_v) == "hopper" and no_grad_takes_hopper_forward(q, indices, d_v):
        # Loops stop at each query's key extent here too: the seesaw kernel with the extent (its launch included)
        # beat the every-slot variant even on full rows (H200, 4096 queries: 0.8-4 %), and a served prefill's
        # first topk positions have short rows.
        return sparse_mla_fwd_hopper(q, kv, indices, float(sm_scale), int(d_v))
    if select_decode(q, kv, indices, d_v) == "hopper":
        return sparse_mla_decode_hopper(q, kv, indices, float(sm_scale), int(d_v))
    return sparse_mla_decode_triton(q, kv, indices, float(sm_scale), int(d_v))
