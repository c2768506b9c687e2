"""Launchers (grids, block sizes) of the `dense_indexer_kl` kernels (`triton_dense_kl.py`).

Memory: the op keeps lse [L, B, H, T], KL and LSE_I [B, T] (fp32) and, in the backward, fp32 gradient buffers the
size of q_I, k_I and w. Nothing is [T, S]. Grids depend on shapes only.
"""
from __future__ import annotations

import torch
import triton

from .triton_dense_kl import LOG2E, _attn_lse_kernel, _kl_bwd_kernel, _kl_fwd_kernel


def _prec(dtype: torch.dtype) -> str:
    """fp32 dots in IEEE fp32 (the target is fp32 by contract; tf32 would round it); others: tensor-core default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _config(T: int, S: int, D: int, DI: int, overrides: dict | None) -> dict:
    """Block sizes. On an H200 at 8K context (one served layer, bf16) key blocks of 128 made the KL forward and
    backward faster than 64, and 128-query blocks slower; the lse pass keeps 64 x 64."""
    small = T <= 64 or S <= 64  # the interpreter's tiny test shapes: keep several blocks per axis
    cfg = dict(
        BLOCK_T=16 if small else 64, BLOCK_S=16 if small else 128, LSE_BLOCK_S=16 if small else 64,
        BLOCK_D=max(16, min(64, triton.next_power_of_2(D))), BLOCK_DI=max(16, triton.next_power_of_2(DI)),
        lse_warps=4, lse_stages=2, fwd_warps=8, fwd_stages=2, bwd_warps=8,
    )
    cfg.update(overrides or {})
    return cfg


def _attn_strides(q, k, lse):
    return (q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            lse.stride(0), lse.stride(1), lse.stride(2))


def attn_lse_triton(q, k, positions, sm_scale: float, cfg: dict) -> torch.Tensor:
    """q [L, B, T, H, D], k [L, B, S, H, D], positions [B, T] -> base-2 lse of sm_scale * q.k over visible keys,
    fp32 [L, B, H, T] (0 for a query with no visible key)."""
    L, B, T, H, D = q.shape
    S = k.shape[2]
    lse = torch.full((L, B, H, T), float("nan"), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), L * H, B)
    s = _attn_strides(q, k, lse)
    _attn_lse_kernel[grid](
        q, k, positions, lse, T, S, H, D, *s[:8], positions.stride(0), positions.stride(1), *s[8:],
        float(sm_scale) * LOG2E,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_S=cfg["LSE_BLOCK_S"], BLOCK_D=cfg["BLOCK_D"], PREC=_prec(q.dtype),
        num_warps=cfg["lse_warps"], num_stages=cfg["lse_stages"],
    )
    return lse


def _common_args(q, k, lse, q_i, k_i, w, positions, sm_scale):
    L, B, T, H, D = q.shape
    S, HI, DI = k.shape[2], q_i.shape[2], q_i.shape[3]
    return (
        T, S, L, H, D, HI, DI, *_attn_strides(q, k, lse),
        q_i.stride(0), q_i.stride(1), q_i.stride(2), k_i.stride(0), k_i.stride(1),
        w.stride(0), w.stride(1), w.stride(2), positions.stride(0), positions.stride(1),
        float(sm_scale) * LOG2E, 1.0 / (L * H),
    )


def kl_forward_triton(q, k, lse, q_i, k_i, w, positions, sm_scale: float, cfg: dict):
    """-> KL per query fp32 [B, T] (0 for a query with no visible key), LSE_I (natural log) fp32 [B, T]."""
    B, T = q_i.shape[:2]
    kl = torch.full((B, T), float("nan"), device=q.device, dtype=torch.float32)
    lse_i = torch.full((B, T), float("nan"), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), B)
    _kl_fwd_kernel[grid](
        q, k, lse, q_i, k_i, w, positions, kl, lse_i, *_common_args(q, k, lse, q_i, k_i, w, positions, sm_scale),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_S=cfg["BLOCK_S"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DI=cfg["BLOCK_DI"],
        PREC=_prec(q.dtype), PREC_I=_prec(q_i.dtype), num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"],
    )
    return kl, lse_i


def kl_backward_triton(q, k, lse, q_i, k_i, w, positions, lse_i, coef, sm_scale: float, cfg: dict):
    """coef [B, T] fp32 = dLoss/dKL_t -> fp32 dq_I [B, T, H_I, D_I], dk_I [B, S, D_I], dw [B, T, H_I]."""
    B, T, HI, DI = q_i.shape
    S = k_i.shape[1]
    dq_i = torch.zeros(B, T, HI, DI, device=q.device, dtype=torch.float32)  # read-modify-write: must start at 0
    dk_i = torch.zeros(B, S, DI, device=q.device, dtype=torch.float32)  # atomics
    dw = torch.full((B, T, HI), float("nan"), device=q.device, dtype=torch.float32)  # every row is stored
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), B)
    # num_stages=1: no software pipelining, so a dq row's load is never hoisted above the previous block's store.
    _kl_bwd_kernel[grid](
        q, k, lse, q_i, k_i, w, positions, lse_i, coef, dq_i, dk_i, dw,
        *_common_args(q, k, lse, q_i, k_i, w, positions, sm_scale),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_S=cfg["BLOCK_S"], BLOCK_D=cfg["BLOCK_D"], BLOCK_DI=cfg["BLOCK_DI"],
        BLOCK_HI=max(16, triton.next_power_of_2(HI)), PREC=_prec(q.dtype), PREC_I=_prec(q_i.dtype),
        num_warps=cfg["bwd_warps"], num_stages=1,
    )
    return dq_i, dk_i, dw
