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
def _head_tile(q0, T, H, D_V, D_T, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr):
    """This (head block, query) program's tile: its query row in the launch (pid_l), batch b and token t of query
    q0 + pid_l, and the offsets and masks of its heads, value (latent) columns and rope-tail columns."""
    pid_l = tl.program_id(1).to(tl.int64)
    pid_q = q0 + pid_l
    offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dt = tl.arange(0, BLOCK_DT)
    return pid_l, pid_q // T, pid_q % T, offs_h, offs_h < H, offs_dv, offs_dv < D_V, offs_dt, offs_dt < D_T


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
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, g_ptr,
    T, S, K, H, D_V, D_T, sm_scale, scale_log2, q0,
    s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_dob, s_dot, s_doh, s_lb, s_lt, s_gq, s_gh,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, STORE_G: tl.constexpr, COMPUTE_DQ: tl.constexpr,
):
    """One program per (head block, query): dq = sum over row blocks of dS . K, kept in registers.
    STORE_G: also write dS and P (the dkv kernel's A operand) to g [chunk, 2H, K] (rows 0..H-1 dS, H..2H-1 P)
    for the queries q0 + program_id(1) of this launch. COMPUTE_DQ=False: only S, dP and the G stores (dq then
    comes from `_sparse_mla_bwd_dq_gemm_kernel`), which frees the [BH, d_qk] fp32 accumulator's registers."""
    pid_l, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok = _head_tile(
        q0, T, H, D_V, D_T, BLOCK_H, BLOCK_DV, BLOCK_DT)
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
        if STORE_G:
            g_rows = g_ptr + pid_l * s_gq + offs_h[:, None] * s_gh + offs_k[None, :]
            g_ok = h_ok[:, None] & (offs_k < K)[None, :]
            tl.store(g_rows, ds.to(g_ptr.dtype.element_ty), mask=g_ok)
            tl.store(g_rows + H * s_gh, p.to(g_ptr.dtype.element_ty), mask=g_ok)
        if COMPUTE_DQ:
            dq_nope = tl.dot(ds, k_nope, dq_nope)
            if HAS_TAIL:
                dq_tail = tl.dot(ds, k_tail, dq_tail)
    if COMPUTE_DQ:
        dq_rows = dq_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        tl.store(dq_rows + offs_dv[None, :], dq_nope.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & dv_ok[None, :])
        if HAS_TAIL:
            tl.store(dq_rows + D_V + offs_dt[None, :], dq_tail.to(dq_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & dt_ok[None, :])


@triton.jit
def _sparse_mla_bwd_dq_gemm_kernel(
    g_ptr, kv_ptr, idx_ptr, dq_ptr,
    T, S, K, H, D_V, D_T, q0,
    s_gq, s_gh, s_kvb, s_kvs, s_ib, s_it, s_qb, s_qt, s_qh,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    """Two-pass dq: one program per (head block, query), dq = dS [BH, K] . K_rows [K, d_qk] with dS read from G
    (a gathered GEMM, no softmax recompute)."""
    pid_l, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok = _head_tile(
        q0, T, H, D_V, D_T, BLOCK_H, BLOCK_DV, BLOCK_DT)
    dq_nope = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], tl.float32)
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    g_rows = g_ptr + pid_l * s_gq + offs_h[:, None] * s_gh
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        idx = tl.load(idx_base + offs_k, mask=k_ok, other=-1)
        valid = (idx >= 0) & (idx < S)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
        ds = tl.load(g_rows + offs_k[None, :], mask=h_ok[:, None] & k_ok[None, :], other=0.0)  # 0 where invalid
        k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        dq_nope = tl.dot(ds, k_nope, dq_nope)
        if HAS_TAIL:
            k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
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


@triton.jit
def _sparse_mla_bwd_dkv_gemm_kernel(
    g_ptr, q_ptr, do_ptr, idx_ptr, dkv_ptr,
    T, S, K, H, q0, col0, n_cols, n_j,
    s_gq, s_gh, s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_ib, s_it, s_dkvb, s_dkvs,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, ATOMIC: tl.constexpr,
):
    """Second pass of the two-pass dkv: one program per (column block, row block, query), no recompute.
    dkv[rows, cols] += G^T [BK, 2H] . B [2H, BN] with G = [dS; P] from the dq kernel and B = [Q; dO] (rows j < H
    from q, j >= H from dO). The rope tail columns are a separate launch with n_j = H (no P . dO term)."""
    pid_n = tl.program_id(0)  # fastest: the column blocks of one row block share its G tile in L2
    pid_k = tl.program_id(1)
    pid_l = tl.program_id(2).to(tl.int64)
    pid_q = q0 + pid_l
    b = pid_q // T
    t = pid_q % T
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    idx = tl.load(idx_ptr + b * s_ib + t * s_it + offs_k, mask=k_ok, other=-1)
    valid = (idx >= 0) & (idx < S)
    offs_n = col0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < col0 + n_cols
    g_base = g_ptr + pid_l * s_gq
    q_base = q_ptr + b * s_qb + t * s_qt
    do_base = do_ptr + b * s_dob + t * s_dot
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for j0 in range(0, n_j, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < n_j
        is_q = offs_j < H
        g = tl.load(g_base + offs_j[:, None] * s_gh + offs_k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BJ, BK]
        b_rows = tl.where(is_q, q_base + offs_j * s_qh, do_base + (offs_j - H) * s_doh)
        bt = tl.load(b_rows[:, None] + offs_n[None, :], mask=j_ok[:, None] & n_ok[None, :], other=0.0)  # [BJ, BN]
        acc = tl.dot(tl.trans(g), bt, acc)
    row = tl.where(valid, idx, 0).to(tl.int64)
    dkv_rows = dkv_ptr + b * s_dkvb + row[:, None] * s_dkvs
    if ATOMIC:
        tl.atomic_add(dkv_rows + offs_n[None, :], acc, mask=valid[:, None] & n_ok[None, :], sem="relaxed")
    else:  # benchmark diagnostic only (wrong sums): the same bytes as plain stores, to price the atomics
        tl.store(dkv_rows + offs_n[None, :], acc, mask=valid[:, None] & n_ok[None, :])


def bwd_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes for both backward kernels (dq_*, dkv_* and gemm_* keys). dkv_mode "gemm" (two-pass: the dq
    kernel writes dS and P, a GEMM kernel forms dkv without recompute) or "fused" (the one-pass dkv kernel, which
    recomputes S and dP). Shared memory of the fused dkv kernel holds q, dO and one row tile at once ([64, 576] +
    [64, 512] + [BK, 576] in bf16 at DeepSeek shapes), so its row blocks stay small."""
    H = q.shape[2]
    bh = min(64, max(16, triton.next_power_of_2(H)))
    bk = min(32, max(16, triton.next_power_of_2(K)))
    cfg = dict(
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        dq_BLOCK_H=bh, dq_BLOCK_K=bk, dq_num_warps=4, dq_num_stages=1,
        dkv_BLOCK_H=min(bh, 32), dkv_BLOCK_K=bk, dkv_num_warps=4, dkv_num_stages=1, dkv_S_FIRST=False,
        dkv_mode="gemm", dq_mode="gemm", g_max_bytes=2**30,
        dqg_BLOCK_H=bh, dqg_BLOCK_K=min(64, max(16, triton.next_power_of_2(K))), dqg_num_warps=4, dqg_num_stages=2,
        gemm_BLOCK_K=min(128, max(16, triton.next_power_of_2(K))),
        gemm_BLOCK_N=min(128, max(16, triton.next_power_of_2(d_v))),
        gemm_BLOCK_J=min(64, max(16, triton.next_power_of_2(H))), gemm_num_warps=8, gemm_num_stages=3,
        tail_BLOCK_N=max(16, triton.next_power_of_2(max(d_tail, 1))), tail_num_warps=4,
        gemm_ATOMIC=True,  # False only in the benchmark's diagnostic (plain stores: wrong dkv)
    )
    if cfg["BLOCK_DV"] >= 256:  # [64, 512] fp32 accumulators need two warpgroups' registers
        cfg.update(dq_num_warps=8, dkv_num_warps=8, dq_BLOCK_K=min(64, max(16, triton.next_power_of_2(K))),
                   dqg_num_warps=8)
    if q.element_size() > 2:
        cfg.update(dq_BLOCK_K=16, dkv_BLOCK_K=16, dkv_BLOCK_H=min(bh, 16), dqg_BLOCK_K=16, dqg_num_stages=1,
                   gemm_BLOCK_K=min(cfg["gemm_BLOCK_K"], 64),
                   gemm_BLOCK_N=min(cfg["gemm_BLOCK_N"], 64), gemm_BLOCK_J=min(cfg["gemm_BLOCK_J"], 32),
                   gemm_num_stages=2)
    if cfg["gemm_BLOCK_K"] * cfg["gemm_BLOCK_N"] < 128 * 128:
        cfg.update(gemm_num_warps=4)
    cfg.update(overrides or {})
    return cfg


def sparse_mla_bwd_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    d_out: torch.Tensor, d_lse: torch.Tensor | None, sm_scale: float, d_v: int, overrides: dict | None = None,
    parts: tuple[str, ...] = ("dq", "dkv"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32, out/d_out [B, T, H, d_v], lse/d_lse [B, T, H]
    -> dq [B, T, H, D_qk] q.dtype, dkv [B, S, D_qk] kv.dtype. Last dims contiguous (the dispatcher ensures it).
    `parts` lets the benchmark time one kernel alone (the other output is then left unwritten; in "gemm" mode the
    dkv part alone runs only the GEMM kernels on an unwritten dS/P buffer, so its dkv is garbage: timing only).
    dq_mode "gemm" (two-pass dq: the first kernel only writes dS and P, `_sparse_mla_bwd_dq_gemm_kernel` forms
    dq = dS . K) or "fused" (dq accumulated in the first kernel).

    gemm mode works in query chunks so that the [chunk, 2H, K] dS/P buffer stays under g_max_bytes; the chunk
    count and every grid depend on shapes only (CUDA-graph safe)."""
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
    gemm = cfg["dkv_mode"] == "gemm"  # the dq kernel then also writes dS and P (timed with it when parts=("dq",))
    dq_gemm = cfg["dq_mode"] == "gemm" and "dq" in parts
    store_g = gemm or dq_gemm
    n_q = B * T
    chunk = max(1, min(n_q, cfg["g_max_bytes"] // (2 * H * K * q.element_size()))) if store_g else n_q
    g = torch.empty(chunk, 2 * H, K, device=q.device, dtype=q.dtype) if store_g else dq  # dq: unused placeholder
    common = (T, S, K, H, d_v, d_tail, sm_scale, sm_scale * LOG2E)
    strides = (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0),
               indices.stride(1), d_out.stride(0), d_out.stride(1), d_out.stride(2), lse.stride(0), lse.stride(1))
    dims = dict(BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"], HAS_TAIL=d_tail > 0)
    for q0 in range(0, n_q, chunk):
        n = min(chunk, n_q - q0)
        if "dq" in parts:
            _sparse_mla_bwd_dq_kernel[(triton.cdiv(H, cfg["dq_BLOCK_H"]), n)](
                q, kv, indices, d_out, lse, delta, dq, g, *common, q0, *strides, g.stride(0), g.stride(1),
                BLOCK_H=cfg["dq_BLOCK_H"], BLOCK_K=cfg["dq_BLOCK_K"], STORE_G=store_g, COMPUTE_DQ=not dq_gemm,
                **dims, num_warps=cfg["dq_num_warps"], num_stages=cfg["dq_num_stages"],
            )
        if dq_gemm:
            _sparse_mla_bwd_dq_gemm_kernel[(triton.cdiv(H, cfg["dqg_BLOCK_H"]), n)](
                g, kv, indices, dq, T, S, K, H, d_v, d_tail, q0, g.stride(0), g.stride(1), kv.stride(0),
                kv.stride(1), indices.stride(0), indices.stride(1), q.stride(0), q.stride(1), q.stride(2),
                BLOCK_H=cfg["dqg_BLOCK_H"], BLOCK_K=cfg["dqg_BLOCK_K"], **dims,
                num_warps=cfg["dqg_num_warps"], num_stages=cfg["dqg_num_stages"],
            )
        if gemm and "dkv" in parts:
            bk, bn = cfg["gemm_BLOCK_K"], cfg["gemm_BLOCK_N"]
            gs = (g.stride(0), g.stride(1), q.stride(0), q.stride(1), q.stride(2), d_out.stride(0), d_out.stride(1),
                  d_out.stride(2), indices.stride(0), indices.stride(1), dkv.stride(0), dkv.stride(1))
            _sparse_mla_bwd_dkv_gemm_kernel[(triton.cdiv(d_v, bn), triton.cdiv(K, bk), n)](
                g, q, d_out, indices, dkv, T, S, K, H, q0, 0, d_v, 2 * H, *gs,
                BLOCK_K=bk, BLOCK_N=bn, BLOCK_J=cfg["gemm_BLOCK_J"], ATOMIC=cfg["gemm_ATOMIC"],
                num_warps=cfg["gemm_num_warps"], num_stages=cfg["gemm_num_stages"],
            )
            if d_tail > 0:
                bt = cfg["tail_BLOCK_N"]
                _sparse_mla_bwd_dkv_gemm_kernel[(triton.cdiv(d_tail, bt), triton.cdiv(K, bk), n)](
                    g, q, d_out, indices, dkv, T, S, K, H, q0, d_v, d_tail, H, *gs,
                    BLOCK_K=bk, BLOCK_N=bt, BLOCK_J=cfg["gemm_BLOCK_J"], ATOMIC=cfg["gemm_ATOMIC"],
                    num_warps=cfg["tail_num_warps"], num_stages=cfg["gemm_num_stages"],
                )
    if "dkv" in parts and not gemm:
        _sparse_mla_bwd_dkv_kernel[(triton.cdiv(K, cfg["dkv_BLOCK_K"]), n_q)](
            q, kv, indices, d_out, lse, delta, dkv, *common, *strides, dkv.stride(0), dkv.stride(1),
            BLOCK_H=cfg["dkv_BLOCK_H"], BLOCK_K=cfg["dkv_BLOCK_K"], S_FIRST=cfg["dkv_S_FIRST"], **dims,
            num_warps=cfg["dkv_num_warps"], num_stages=cfg["dkv_num_stages"],
        )
    return dq, dkv.to(kv.dtype)
