"""Triton backward kernel for MQA-mode sparse MLA: dq per program, dkv by fp32 atomics.

One program per (head block, query) recomputes P = exp(S - lse) block by block over the K selected rows:
  dP = dO . V^T,  dS = P * (dP - delta) * sm_scale   with delta = rowsum(dO * O) - dlse
  dq  += dS . K                       (kept in registers, written once)
  dkv[rows] += dS^T . Q  (+ P^T . dO on the value columns)   (atomic fp32 adds: rows are shared across queries)
The dlse term makes lse differentiable too (d lse / d s = P). Invalid indices contribute nothing and are not read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_prefill import LOG2E


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    T, S, K, H, D_V, D_T, sm_scale, scale_log2,
    s_qb, s_qt, s_qh,
    s_kvb, s_kvs,
    s_ib, s_it,
    s_dob, s_dot, s_doh,
    s_lb, s_lt,
    s_dkvb, s_dkvs,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_q = tl.program_id(1).to(tl.int64)
    b = pid_q // T
    t = pid_q % T

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    hv_ok = h_ok[:, None] & dv_ok[None, :]
    q_rows = q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    q_nope = tl.load(q_rows + offs_dv[None, :], mask=hv_ok, other=0.0)
    do = tl.load(do_ptr + b * s_dob + t * s_dot + offs_h[:, None] * s_doh + offs_dv[None, :], mask=hv_ok, other=0.0)
    if HAS_TAIL:
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_ok = offs_dt < D_T
        q_tail = tl.load(q_rows + D_V + offs_dt[None, :], mask=h_ok[:, None] & dt_ok[None, :], other=0.0)
        dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], tl.float32)
    lse = tl.load(lse_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # no valid key: every P is 0 anyway
    delta = tl.load(delta_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=0.0)
    dq_nope = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    kv_base = kv_ptr + b * s_kvb
    dkv_base = dkv_ptr + b * s_dkvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = (idx >= 0) & (idx < S)
        row = tl.where(valid, idx, 0).to(tl.int64)[:, None]
        k_nope = tl.load(kv_base + row * s_kvs + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope))
        if HAS_TAIL:
            k_tail = tl.load(kv_base + row * s_kvs + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :],
                             other=0.0)
            s = tl.dot(q_tail, tl.trans(k_tail), s)
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(h_ok[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_nope))
        ds = (p * (dp - delta[:, None]) * sm_scale).to(k_nope.dtype)
        dq_nope = tl.dot(ds, k_nope, dq_nope)
        dkv_nope = tl.dot(tl.trans(ds), q_nope)
        dkv_nope = tl.dot(tl.trans(p.to(do.dtype)), do, dkv_nope)
        tl.atomic_add(dkv_base + row * s_dkvs + offs_dv[None, :], dkv_nope, mask=valid[:, None] & dv_ok[None, :],
                      sem="relaxed")
        if HAS_TAIL:
            dq_tail = tl.dot(ds, k_tail, dq_tail)
            dkv_tail = tl.dot(tl.trans(ds), q_tail)
            tl.atomic_add(dkv_base + row * s_dkvs + D_V + offs_dt[None, :], dkv_tail,
                          mask=valid[:, None] & dt_ok[None, :], sem="relaxed")

    dq_rows = dq_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    tl.store(dq_rows + offs_dv[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=hv_ok)
    if HAS_TAIL:
        tl.store(dq_rows + D_V + offs_dt[None, :], dq_tail.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & dt_ok[None, :])


def bwd_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes for the backward. The dq accumulator [BLOCK_H, d_qk] fp32 plus a [BLOCK_K, d_v] fp32 dkv tile
    live in registers, so BLOCK_K stays small at d_v = 512."""
    H = q.shape[2]
    cfg = dict(
        BLOCK_H=min(64, max(16, triton.next_power_of_2(H))),
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        BLOCK_K=min(32, max(16, triton.next_power_of_2(K))),
        num_warps=4,
        num_stages=1,
    )
    if cfg["BLOCK_DV"] * cfg["BLOCK_H"] >= 64 * 256:
        cfg.update(num_warps=8, BLOCK_K=min(cfg["BLOCK_K"], 16 if q.element_size() > 2 else 32))
    cfg.update(overrides or {})
    return cfg


def sparse_mla_bwd_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    d_out: torch.Tensor, d_lse: torch.Tensor | None, sm_scale: float, d_v: int, overrides: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32, out/d_out [B, T, H, d_v], lse/d_lse [B, T, H]
    -> dq [B, T, H, D_qk] q.dtype, dkv [B, S, D_qk] kv.dtype. Last dims contiguous (the dispatcher ensures it)."""
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    d_tail = D_qk - d_v
    delta = (d_out.float() * out.float()).sum(-1)  # [B, T, H]
    if d_lse is not None:
        delta = delta - d_lse.float()
    delta = delta.contiguous()
    lse = lse.contiguous()
    q = q.contiguous()  # dq shares q's strides
    d_out = d_out.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(B, S, D_qk, device=kv.device, dtype=torch.float32)
    cfg = bwd_config(q, d_v, d_tail, K, overrides)
    grid = (triton.cdiv(H, cfg["BLOCK_H"]), B * T)
    _sparse_mla_bwd_kernel[grid](
        q, kv, indices, d_out, lse, delta, dq, dkv,
        T, S, K, H, d_v, d_tail, sm_scale, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        lse.stride(0), lse.stride(1),
        dkv.stride(0), dkv.stride(1),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"],
        HAS_TAIL=d_tail > 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq, dkv.to(kv.dtype)
