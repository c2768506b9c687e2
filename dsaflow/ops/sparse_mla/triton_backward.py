"""Triton backward kernels for MQA-mode sparse MLA: dq per (head block, query), dkv per (row block, query).

Both recompute P = exp(S - lse) from the saved lse:
  dP = dO . V^T,  dS = P * (dP - delta) * sm_scale   with delta = rowsum(dO * O) - dlse
  dq  = sum over rows of dS . K                                  (`_sparse_mla_bwd_dq_kernel`, registers)
  dkv[rows] += dS^T . Q  (+ P^T . dO on the value columns)         (`_sparse_mla_bwd_dkv_kernel`, fp32 atomics:
                                                                    rows are shared across queries)
Two kernels instead of one fused loop because the fused program needs q, dO, a row tile and the dkv tile's layout
conversion in shared memory at once (280+ KB at DeepSeek shapes, over the 227 KB limit); the price is recomputing
S and dP (1088 of 3840 FLOPs per head-row). The dlse term makes lse differentiable (d lse / d s = P). Invalid
indices contribute nothing and are not read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_prefill import LOG2E


@triton.jit
def _load_q_do(q_ptr, do_ptr, lse_ptr, delta_ptr, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok,
               s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_lb, s_lt, D_V, HAS_TAIL: tl.constexpr):
    """q [BH, DV] (+ tail [BH, DT]), dO [BH, DV], lse in base 2 (0 where -inf: every P is 0 then), delta [BH]."""
    q_rows = q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    q_nope = tl.load(q_rows + offs_dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    q_tail = tl.zeros([1, 1], q_nope.dtype)
    if HAS_TAIL:
        q_tail = tl.load(q_rows + D_V + offs_dt[None, :], mask=h_ok[:, None] & dt_ok[None, :], other=0.0)
    do = tl.load(do_ptr + b * s_dob + t * s_dot + offs_h[:, None] * s_doh + offs_dv[None, :],
                 mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=0.0)
    return q_nope, q_tail, do, lse2, delta


@triton.jit
def _sparse_mla_bwd_dq_kernel(
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    T, S, K, H, D_V, D_T, sm_scale, scale_log2,
    s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_dob, s_dot, s_doh, s_lb, s_lt,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    """One program per (head block, query): dq = sum over row blocks of dS . K, kept in registers."""
    pid_h = tl.program_id(0)
    pid_q = tl.program_id(1).to(tl.int64)
    b = pid_q // T
    t = pid_q % T
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_T
    q_nope, q_tail, do, lse2, delta = _load_q_do(
        q_ptr, do_ptr, lse_ptr, delta_ptr, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok,
        s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_lb, s_lt, D_V, HAS_TAIL)
    dq_nope = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], tl.float32)
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = (idx >= 0) & (idx < S)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
        k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope))
        if HAS_TAIL:
            k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
            s = tl.dot(q_tail, tl.trans(k_tail), s)
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(h_ok[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_nope))
        ds = (p * (dp - delta[:, None]) * sm_scale).to(k_nope.dtype)
        dq_nope = tl.dot(ds, k_nope, dq_nope)
        if HAS_TAIL:
            dq_tail = tl.dot(ds, k_tail, dq_tail)
    dq_rows = dq_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    tl.store(dq_rows + offs_dv[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    if HAS_TAIL:
        tl.store(dq_rows + D_V + offs_dt[None, :], dq_tail.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & dt_ok[None, :])


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr,
    T, S, K, H, D_V, D_T, sm_scale, scale_log2,
    s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_dob, s_dot, s_doh, s_lb, s_lt, s_dkvb, s_dkvs,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, S_FIRST: tl.constexpr,
):
    """One program per (row block, query): loops over all head blocks, so each selected row gets one atomic add
    per query. S_FIRST=False works on transposed scores S^T = K . Q^T [BK, BH] (the row tile is the A operand, no
    register transposes); S_FIRST=True computes S = Q . K^T [BH, BK] (row tile as B operand, from shared memory)
    and transposes the small dS / P tiles instead."""
    pid_k = tl.program_id(0)
    pid_q = tl.program_id(1).to(tl.int64)
    b = pid_q // T
    t = pid_q % T
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_T
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    idx = tl.load(idx_ptr + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)
    valid = (idx >= 0) & (idx < S)
    row = tl.where(valid, idx, 0).to(tl.int64)[:, None]
    kv_rows = kv_ptr + b * s_kvb + row * s_kvs
    k_nope = tl.load(kv_rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)  # [BK, DV]
    k_tail = tl.zeros([1, 1], k_nope.dtype)
    if HAS_TAIL:
        k_tail = tl.load(kv_rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
    acc_nope = tl.zeros([BLOCK_K, BLOCK_DV], tl.float32)
    acc_tail = tl.zeros([BLOCK_K, BLOCK_DT], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        q_nope, q_tail, do, lse2, delta = _load_q_do(
            q_ptr, do_ptr, lse_ptr, delta_ptr, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok,
            s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_lb, s_lt, D_V, HAS_TAIL)
        if S_FIRST:
            s = tl.dot(q_nope, tl.trans(k_nope))  # [BH, BK]
            if HAS_TAIL:
                s = tl.dot(q_tail, tl.trans(k_tail), s)
            p = tl.exp2(s * scale_log2 - lse2[:, None])
            p = tl.where(h_ok[:, None] & valid[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(k_nope))
            ds = (p * (dp - delta[:, None]) * sm_scale).to(q_nope.dtype)
            ds_t = tl.trans(ds)
            p_t = tl.trans(p.to(do.dtype))
        else:
            s_t = tl.dot(k_nope, tl.trans(q_nope))  # [BK, BH]
            if HAS_TAIL:
                s_t = tl.dot(k_tail, tl.trans(q_tail), s_t)
            p_t = tl.exp2(s_t * scale_log2 - lse2[None, :])
            p_t = tl.where(valid[:, None] & h_ok[None, :], p_t, 0.0)
            dp_t = tl.dot(k_nope, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :]) * sm_scale).to(q_nope.dtype)
            p_t = p_t.to(do.dtype)
        acc_nope = tl.dot(ds_t, q_nope, acc_nope)
        acc_nope = tl.dot(p_t, do, acc_nope)
        if HAS_TAIL:
            acc_tail = tl.dot(ds_t, q_tail, acc_tail)
    dkv_rows = dkv_ptr + b * s_dkvb + row * s_dkvs
    tl.atomic_add(dkv_rows + offs_dv[None, :], acc_nope, mask=valid[:, None] & dv_ok[None, :], sem="relaxed")
    if HAS_TAIL:
        tl.atomic_add(dkv_rows + D_V + offs_dt[None, :], acc_tail, mask=valid[:, None] & dt_ok[None, :],
                      sem="relaxed")


def bwd_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes for both backward kernels (dq_* and dkv_* keys). Shared memory holds q, dO and one row tile at
    once ([64, 576] + [64, 512] + [BK, 576] in bf16 at DeepSeek shapes), so the row blocks stay small."""
    H = q.shape[2]
    bh = min(64, max(16, triton.next_power_of_2(H)))
    bk = min(32, max(16, triton.next_power_of_2(K)))
    cfg = dict(
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        dq_BLOCK_H=bh, dq_BLOCK_K=bk, dq_num_warps=4, dq_num_stages=1,
        dkv_BLOCK_H=min(bh, 32), dkv_BLOCK_K=bk, dkv_num_warps=4, dkv_num_stages=1, dkv_S_FIRST=False,
    )
    if cfg["BLOCK_DV"] >= 256:  # [64, 512] fp32 accumulators need two warpgroups' registers
        cfg.update(dq_num_warps=8, dkv_num_warps=8, dq_BLOCK_K=min(64, max(16, triton.next_power_of_2(K))))
    if q.element_size() > 2:
        cfg.update(dq_BLOCK_K=16, dkv_BLOCK_K=16, dkv_BLOCK_H=min(bh, 16))
    cfg.update(overrides or {})
    return cfg


def sparse_mla_bwd_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    d_out: torch.Tensor, d_lse: torch.Tensor | None, sm_scale: float, d_v: int, overrides: dict | None = None,
    parts: tuple[str, ...] = ("dq", "dkv"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32, out/d_out [B, T, H, d_v], lse/d_lse [B, T, H]
    -> dq [B, T, H, D_qk] q.dtype, dkv [B, S, D_qk] kv.dtype. Last dims contiguous (the dispatcher ensures it).
    `parts` lets the benchmark time one kernel alone (the other output is then left unwritten)."""
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
    common = (T, S, K, H, d_v, d_tail, sm_scale, sm_scale * LOG2E,
              q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
              d_out.stride(0), d_out.stride(1), d_out.stride(2), lse.stride(0), lse.stride(1))
    dims = dict(BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"], HAS_TAIL=d_tail > 0)
    if "dq" in parts:
        _sparse_mla_bwd_dq_kernel[(triton.cdiv(H, cfg["dq_BLOCK_H"]), B * T)](
            q, kv, indices, d_out, lse, delta, dq, *common,
            BLOCK_H=cfg["dq_BLOCK_H"], BLOCK_K=cfg["dq_BLOCK_K"], **dims,
            num_warps=cfg["dq_num_warps"], num_stages=cfg["dq_num_stages"],
        )
    if "dkv" in parts:
        _sparse_mla_bwd_dkv_kernel[(triton.cdiv(K, cfg["dkv_BLOCK_K"]), B * T)](
            q, kv, indices, d_out, lse, delta, dkv, *common, dkv.stride(0), dkv.stride(1),
            BLOCK_H=cfg["dkv_BLOCK_H"], BLOCK_K=cfg["dkv_BLOCK_K"], S_FIRST=cfg["dkv_S_FIRST"], **dims,
            num_warps=cfg["dkv_num_warps"], num_stages=cfg["dkv_num_stages"],
        )
    return dq, dkv.to(kv.dtype)
