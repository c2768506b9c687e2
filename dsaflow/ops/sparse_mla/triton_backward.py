"""Triton backward kernels for MQA-mode sparse MLA: two passes per query chunk, no softmax recompute after pass 1.

With P = exp(S - lse) from the saved lse, dP = dO . V^T, dS = P * (dP - delta) * sm_scale, delta = rowsum(dO * O)
- dlse (the dlse term makes lse differentiable: d lse / d s = P):
  pass 1  `_sparse_mla_bwd_ds_kernel`       per (head block, query): delta from its dO and O tiles (fp32), then S,
          dP; writes dS and P to G [chunk, 2H, K]
  dq      `_sparse_mla_bwd_dq_gemm_kernel`  per (head block, query): dq = dS [BH, K] . K_rows [K, d_qk]
  dkv     `_sparse_mla_bwd_dkv_gemm_kernel` per (column block, row block, query): G^T [BK, 2H] . [Q; dO] [2H, BN]
          default: fp32 atomics into dkv (rows are shared across queries, so the summation order varies by run);
          deterministic mode: plain stores into C [chunk, K, d_qk] fp32, then `_sparse_mla_bwd_dkv_reduce_kernel`
          sums each key row's entries in a fixed order (query, then slot: a stable sort of the chunk's indices).
Executed FLOPs equal the useful 2 H K (3 d_qk + 2 d_v) per query. Invalid indices contribute nothing and are not
read. Every kernel stops at the query's key extent n_keys (`triton_prefill.key_extent`: 1 + its last valid slot; in
causal training query t < topk has t + 1 keys): pass 1 and dq loop over [0, n_keys), dkv programs whose row block
starts at or past n_keys do no work, and G is read only below n_keys (pass 1 writes it up to its last block there).
Grids are one-dimensional (CUDA caps grid axes 1 and 2 at 65,535; B*T reaches 2^20), program id -> tile with the
tiles that share data adjacent in launch order; ids and offsets derived from them are int64. Grids, chunk counts and
buffers depend on shapes only. fp32 inputs use IEEE fp32 dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import hopper_backward
from .triton_prefill import LOG2E, _rotated_blocks, dot_precision, key_extent
from .triton_probs_add import _probs_into_kernel

PASS1 = ("triton", "hopper")  # `_sparse_mla_bwd_ds_kernel`, or `hopper_backward`'s Gluon pass 1 (sm_90)


@triton.jit
def _head_tile(q0, T, H, D_V, D_T, n_hb, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr):
    """This (head block, query) program's tile from the 1-D program id (head block fastest, so the head blocks of
    one query share its gathered rows in L2): its query row in the chunk (pid_l), batch b and token t of query
    q0 + pid_l, and the offsets and masks of its heads, value (latent) columns and rope-tail columns."""
    pid = tl.program_id(0).to(tl.int64)
    pid_l = pid // n_hb
    pid_q = q0 + pid_l
    offs_h = (pid % n_hb).to(tl.int32) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dt = tl.arange(0, BLOCK_DT)
    return pid_l, pid_q // T, pid_q % T, offs_h, offs_h < H, offs_dv, offs_dv < D_V, offs_dt, offs_dt < D_T


@triton.jit
def _sparse_mla_bwd_ds_kernel(
    q_ptr, kv_ptr, idx_ptr, nk_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, g_ptr, ps_ptr,
    T, S, K, H, D_V, D_T, sm_scale, scale_log2, q0, n_hb,
    s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_dob, s_dot, s_doh, s_ob, s_ot, s_oh, s_lb, s_lt, s_dlb, s_dlt,
    s_gq, s_gh, s_psh, s_psq,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, HAS_DLSE: tl.constexpr, DOT_PREC: tl.constexpr, SUM_P: tl.constexpr,
):
    """Pass 1, one program per (head block, query): delta = rowsum(dO * O) - dlse for its heads (fp32, from the
    dO tile it needs anyway and one read of O), then S and dP per row block up to the query's key extent, dS and P
    written to g [chunk, 2H, K] (rows 0..H-1 dS, H..2H-1 P; 0 at invalid indices) for the queries q0 + pid_l.
    SUM_P: also the fp32 sum of P over its heads per slot, to ps [n_hb, chunk, K], for `_probs_into_kernel` (the
    indexer-loss target, from P this pass computes anyway)."""
    pid_l, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok = _head_tile(
        q0, T, H, D_V, D_T, n_hb, BLOCK_H, BLOCK_DV, BLOCK_DT)
    q_rows = q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    q_nope = tl.load(q_rows + offs_dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    if HAS_TAIL:
        q_tail = tl.load(q_rows + D_V + offs_dt[None, :], mask=h_ok[:, None] & dt_ok[None, :], other=0.0)
    do = tl.load(do_ptr + b * s_dob + t * s_dot + offs_h[:, None] * s_doh + offs_dv[None, :],
                 mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    o = tl.load(o_ptr + b * s_ob + t * s_ot + offs_h[:, None] * s_oh + offs_dv[None, :],
                mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + b * s_dlb + t * s_dlt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # base 2; every P is 0 where -inf
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    g_base = g_ptr + pid_l * s_gq + offs_h[:, None] * s_gh
    n_k = tl.load(nk_ptr + q0 + pid_l)  # no valid slot at or past it; G past its last block stays unwritten
    ps_row = ps_ptr + (tl.program_id(0).to(tl.int64) % n_hb) * s_psh + pid_l * s_psq
    # G holds slots [0, n_g): pass 1's blocks cover n_k rounded up to its block (zeros past n_k)
    n_blk, rot = _rotated_blocks(q0 + pid_l, n_k, BLOCK_K)
    for i in range(0, n_blk):
        offs_k = ((i + rot) % n_blk) * BLOCK_K + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = (idx >= 0) & (idx < S)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
        k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        if HAS_TAIL:
            k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
            s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=DOT_PREC)
        p = tl.exp2(s * scale_log2 - lse2[:, None])
        p = tl.where(h_ok[:, None] & valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_nope), input_precision=DOT_PREC)
        ds = (p * (dp - delta[:, None]) * sm_scale).to(k_nope.dtype)
        g_ok = h_ok[:, None] & (offs_k < K)[None, :]
        tl.store(g_base + offs_k[None, :], ds.to(g_ptr.dtype.element_ty), mask=g_ok)
        tl.store(g_base + H * s_gh + offs_k[None, :], p.to(g_ptr.dtype.element_ty), mask=g_ok)
        if SUM_P:
            tl.store(ps_row + offs_k, tl.sum(p, 0), mask=offs_k < K)


@triton.jit
def _sparse_mla_bwd_dq_gemm_kernel(
    g_ptr, kv_ptr, idx_ptr, nk_ptr, dq_ptr,
    T, S, K, H, D_V, D_T, q0, n_hb,
    s_gq, s_gh, s_kvb, s_kvs, s_ib, s_it, s_qb, s_qt, s_qh,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, DOT_PREC: tl.constexpr, DS_BLOCK_K: tl.constexpr,
):
    """One program per (head block, query): dq = dS [BH, K] . K_rows [K, d_qk] with dS read from G (a gathered
    GEMM, no softmax recompute, no atomics: deterministic), over the slots below the query's key extent."""
    pid_l, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok = _head_tile(
        q0, T, H, D_V, D_T, n_hb, BLOCK_H, BLOCK_DV, BLOCK_DT)
    dq_nope = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], tl.float32)
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    g_rows = g_ptr + pid_l * s_gq + offs_h[:, None] * s_gh
    n_k = tl.load(nk_ptr + q0 + pid_l)
    n_g = tl.minimum((n_k + DS_BLOCK_K - 1) // DS_BLOCK_K * DS_BLOCK_K, K)  # the G slots pass 1 wrote
    n_blk, rot = _rotated_blocks(q0 + pid_l, n_k, BLOCK_K)
    for i in range(0, n_blk):
        offs_k = ((i + rot) % n_blk) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < n_g  # a block multiple (when K is one): the G loads stay vectorised and pipelined
        idx = tl.load(idx_base + offs_k, mask=k_ok, other=-1)
        valid = (idx >= 0) & (idx < S)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
        ds = tl.load(g_rows + offs_k[None, :], mask=h_ok[:, None] & k_ok[None, :], other=0.0)  # 0 where invalid
        k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        dq_nope = tl.dot(ds, k_nope, dq_nope, input_precision=DOT_PREC)
        if HAS_TAIL:
            k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
            dq_tail = tl.dot(ds, k_tail, dq_tail, input_precision=DOT_PREC)
    dq_rows = dq_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    tl.store(dq_rows + offs_dv[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    if HAS_TAIL:
        tl.store(dq_rows + D_V + offs_dt[None, :], dq_tail.to(dq_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & dt_ok[None, :])


@triton.jit
def _sparse_mla_bwd_dkv_gemm_kernel(
    g_ptr, q_ptr, do_ptr, idx_ptr, nk_ptr, out_ptr,
    T, S, K, H, q0, col0, n_cols, n_j, n_nb, n_kb,
    s_gq, s_gh, s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_ib, s_it, s_ob, s_os, s_cq, s_ck,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, DETERMINISTIC: tl.constexpr,
    DOT_PREC: tl.constexpr, DS_BLOCK_K: tl.constexpr,
):
    """One program per (column block, row block, query), column block fastest (the column blocks of one row block
    share its G tile in L2): acc [BK, BN] = G^T [BK, 2H] . B [2H, BN] with G = [dS; P] and B = [Q; dO] (rows j < H
    from q, j >= H from dO); the rope-tail columns are a separate launch with n_j = H (no P . dO term).
    DETERMINISTIC=False: acc is atomically added to out = dkv [B, S, d_qk] at the selected rows. True: acc is stored
    to out = C [chunk, K, d_qk] at (query, slot) (strides s_cq, s_ck), to be reduced in a fixed order.
    A row block at or past the query's key extent holds no valid slot: its program loads no G and stores nothing."""
    pid = tl.program_id(0).to(tl.int64)
    pid_n = (pid % n_nb).to(tl.int32)
    pid_k = ((pid // n_nb) % n_kb).to(tl.int32)
    pid_l = pid // (n_nb * n_kb)
    pid_q = q0 + pid_l
    b = pid_q // T
    t = pid_q % T
    n_k = tl.load(nk_ptr + pid_q)
    n_g = tl.minimum((n_k + DS_BLOCK_K - 1) // DS_BLOCK_K * DS_BLOCK_K, K)  # the G slots pass 1 wrote
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < n_g
    idx = tl.load(idx_ptr + b * s_ib + t * s_it + offs_k, mask=offs_k < K, other=-1)  # invalid from n_k on
    valid = (idx >= 0) & (idx < S)
    offs_n = col0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < col0 + n_cols
    g_base = g_ptr + pid_l * s_gq
    q_base = q_ptr + b * s_qb + t * s_qt
    do_base = do_ptr + b * s_dob + t * s_dot
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    j_end = tl.where(pid_k * BLOCK_K < n_k, n_j, 0)  # past the extent: no reduction steps, every store masked
    for j0 in range(0, j_end, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < n_j
        is_q = offs_j < H
        g = tl.load(g_base + offs_j[:, None] * s_gh + offs_k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BJ, BK]
        b_rows = tl.where(is_q, q_base + offs_j * s_qh, do_base + (offs_j - H) * s_doh)
        bt = tl.load(b_rows[:, None] + offs_n[None, :], mask=j_ok[:, None] & n_ok[None, :], other=0.0)  # [BJ, BN]
        acc = tl.dot(tl.trans(g), bt, acc, input_precision=DOT_PREC)
    ok = valid[:, None] & n_ok[None, :]
    if DETERMINISTIC:
        c_rows = out_ptr + pid_l * s_cq + offs_k.to(tl.int64)[:, None] * s_ck
        tl.store(c_rows + offs_n[None, :], acc, mask=ok)
    else:
        row = tl.where(valid, idx, 0).to(tl.int64)
        dkv_rows = out_ptr + b * s_ob + row[:, None] * s_os
        tl.atomic_add(dkv_rows + offs_n[None, :], acc, mask=ok, sem="relaxed")


@triton.jit
def _sparse_mla_bwd_dkv_reduce_kernel(
    c_ptr, order_ptr, row_ptr, dkv_ptr, D, s_ce, s_dkvr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Deterministic dkv, one program per key row r of dkv viewed as [B*S, D]: dkv[r] += the sum of C entries
    order[row_ptr[r] : row_ptr[r+1]] (C viewed as [chunk*K, D], entries sorted by query then slot), in blocks of
    BLOCK_E entries summed by a fixed-shape reduction: the same order and result on every run. Rows are owned by
    one program, so the update is a plain load-add-store."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(row_ptr + r)
    hi = tl.load(row_ptr + r + 1)
    if hi > lo:
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            acc = tl.zeros([BLOCK_D], tl.float32)
            for e0 in range(lo, hi, BLOCK_E):
                offs_e = e0 + tl.arange(0, BLOCK_E)
                e_ok = offs_e < hi
                ent = tl.load(order_ptr + offs_e, mask=e_ok, other=0).to(tl.int64)
                tile = tl.load(c_ptr + ent[:, None] * s_ce + offs_d[None, :], mask=e_ok[:, None] & d_ok[None, :],
                               other=0.0)
                acc += tl.sum(tile, 0)
            dst = dkv_ptr + r * s_dkvr + offs_d
            tl.store(dst, tl.load(dst, mask=d_ok, other=0.0) + acc, mask=d_ok)


def bwd_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes of the backward kernels (ds_*: pass 1, dqg_*: dq GEMM, gemm_* / tail_*: dkv GEMM on the value /
    rope-tail columns, red_*: deterministic reduction) and the byte budgets that set the query chunk: g_max_bytes
    for G (1 MiB per query at DeepSeek shapes), det_max_bytes for G + C in deterministic mode (C: K d_qk fp32 per
    query, 4.5 MiB at DeepSeek shapes). Shape-only; the tiles are the fastest of sweeps on an H200."""
    H = q.shape[2]
    bh = min(64, max(16, triton.next_power_of_2(H)))
    cfg = dict(
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        ds_BLOCK_H=bh, ds_BLOCK_K=min(32, max(16, triton.next_power_of_2(K))), ds_num_warps=4, ds_num_stages=1,
        dqg_BLOCK_H=bh, dqg_BLOCK_K=min(64, max(16, triton.next_power_of_2(K))), dqg_num_warps=4, dqg_num_stages=2,
        gemm_BLOCK_K=min(128, max(16, triton.next_power_of_2(K))),
        gemm_BLOCK_N=min(128, max(16, triton.next_power_of_2(d_v))),
        gemm_BLOCK_J=min(64, max(16, triton.next_power_of_2(H))), gemm_num_warps=8, gemm_num_stages=3,
        tail_BLOCK_N=max(16, triton.next_power_of_2(max(d_tail, 1))), tail_num_warps=4,
        red_BLOCK_E=16, red_BLOCK_D=128, red_num_warps=4, probs_BLOCK_K=min(1024, max(16, triton.next_power_of_2(K))),
        g_max_bytes=2**30, det_max_bytes=2**31,
    )
    if cfg["BLOCK_DV"] >= 256:  # [64, 512] fp32 accumulators need two warpgroups' registers
        cfg.update(ds_num_warps=8, ds_BLOCK_K=min(64, max(16, triton.next_power_of_2(K))), dqg_num_warps=8)
    if q.element_size() > 2:
        cfg.update(ds_BLOCK_K=16, dqg_BLOCK_K=16, dqg_num_stages=1,
                   gemm_BLOCK_K=min(cfg["gemm_BLOCK_K"], 64),
                   gemm_BLOCK_N=min(cfg["gemm_BLOCK_N"], 64), gemm_BLOCK_J=min(cfg["gemm_BLOCK_J"], 32),
                   gemm_num_stages=2)
    if cfg["gemm_BLOCK_K"] * cfg["gemm_BLOCK_N"] < 128 * 128:
        cfg.update(gemm_num_warps=4)
    cfg.update(overrides or {})
    return cfg


def _csr_by_key_row(indices_flat: torch.Tensor, q0: int, n: int, T: int, S: int, n_rows: int):
    """Invert the chunk's index map: entries e = l * K + slot of queries q0..q0+n-1, stably sorted by key row
    b * S + index (invalid indices last) -> order [n*K] int32 and row_ptr [B*S + 1] int64 (row r's entries are
    order[row_ptr[r] : row_ptr[r+1]], in query then slot order). Shape-only, no host sync."""
    idx = indices_flat[q0 : q0 + n].long()  # [n, K]
    b = (torch.arange(q0, q0 + n, device=idx.device) // T).unsqueeze(1)
    key = torch.where((idx >= 0) & (idx < S), b * S + idx, n_rows).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    row_ptr = torch.searchsorted(sorted_key, torch.arange(n_rows + 1, device=idx.device))
    return order.to(torch.int32), row_ptr


def sparse_mla_bwd_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    d_out: torch.Tensor, d_lse: torch.Tensor | None, sm_scale: float, d_v: int, overrides: dict | None = None,
    deterministic: bool = False, n_keys: torch.Tensor | None = None,
    probs_into: tuple[torch.Tensor, float] | None = None, pass1: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32, out/d_out [B, T, H, d_v], lse/d_lse [B, T, H]
    -> dq [B, T, H, D_qk] q.dtype, dkv [B, S, D_qk] kv.dtype. q, kv, indices with contiguous last dims (the
    dispatcher ensures it); n_keys [B, T] int32 contiguous = `key_extent(indices, S)` (computed when not given).

    Works in query chunks so that G [chunk, 2H, K] (and C [chunk, K, D_qk] fp32 when deterministic) stays within
    the byte budget; chunks run in a fixed order. deterministic=True: dkv is summed in a fixed order (bit-identical
    across runs on the same inputs and device); dq is deterministic in both modes.
    probs_into = (target [B, T, K] fp32 with unit last stride, weight): pass 1 also sums its P over heads, and
    `_probs_into_kernel` adds weight * that sum / its total into target (the indexer-loss target; see
    `sparse_mla`), deterministically. pass1: one of `PASS1` ("hopper" for inputs `hopper_bwd_supports` takes)."""
    if pass1 not in PASS1:
        raise ValueError(f"sparse_mla_bwd_triton: pass1={pass1!r}, want one of {PASS1}")
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    d_tail = D_qk - d_v
    # One copy at most of out and d_out (no-ops when contiguous). In training d_out arrives head-major ([H, T, d_v]
    # in memory: the backward of the einsum with w_uv), and every dkv program of a query reads it; read in place it
    # made the backward kernels about 1.5x slower in training than on contiguous inputs, far more than the copy.
    out, d_out = out.contiguous(), d_out.contiguous()
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    if d_lse is not None and d_lse.stride(-1) != 1:
        d_lse = d_lse.contiguous()
    if n_keys is None:
        n_keys = key_extent(indices, S)
    q = q.contiguous()  # dq shares q's strides
    dq = torch.empty_like(q)
    dkv = torch.zeros(B, S, D_qk, device=kv.device, dtype=torch.float32)
    cfg = bwd_config(q, d_v, d_tail, K, overrides)
    if pass1 == "hopper":
        cfg.update(ds_BLOCK_H=hopper_backward.BLOCK_H, ds_BLOCK_K=hopper_backward.BLOCK_K)  # the G it writes
    n_q = B * T
    g_per_q = 2 * H * K * q.element_size()
    if deterministic:
        chunk = max(1, min(n_q, cfg["det_max_bytes"] // (g_per_q + K * D_qk * 4)))
        c_buf = torch.empty(chunk, K, D_qk, device=q.device, dtype=torch.float32)
        indices_flat = indices.reshape(n_q, K)
    else:
        chunk = max(1, min(n_q, cfg["g_max_bytes"] // g_per_q))
        c_buf = dkv  # unused placeholder
    g = torch.empty(chunk, 2 * H, K, device=q.device, dtype=q.dtype)
    n_hb = triton.cdiv(H, cfg["ds_BLOCK_H"])
    if probs_into is not None:
        target, weight = probs_into
        if target.shape != (B, T, K) or target.dtype != torch.float32 or target.stride(-1) != 1:
            raise ValueError(f"probs_into: target must be fp32 [B, T, K] = {(B, T, K)} with a unit last stride, got "
                             f"{target.dtype} {tuple(target.shape)} strides {target.stride()}")
        p_sums = torch.empty(n_hb, chunk, K, device=q.device, dtype=torch.float32)
    else:
        p_sums = g  # an unread placeholder
    prec = dot_precision(q.dtype)
    dims = dict(BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"], HAS_TAIL=d_tail > 0, DOT_PREC=prec)
    n_hbg = triton.cdiv(H, cfg["dqg_BLOCK_H"])
    bk, bn, bt = cfg["gemm_BLOCK_K"], cfg["gemm_BLOCK_N"], cfg["tail_BLOCK_N"]
    n_kb = triton.cdiv(K, bk)
    gs = (g.stride(0), g.stride(1), q.stride(0), q.stride(1), q.stride(2), d_out.stride(0), d_out.stride(1),
          d_out.stride(2), indices.stride(0), indices.stride(1), dkv.stride(0), dkv.stride(1),
          c_buf.stride(0), c_buf.stride(1))
    dkv_out = c_buf if deterministic else dkv
    dlse_arg = lse if d_lse is None else d_lse  # an unread placeholder without dlse
    for q0 in range(0, n_q, chunk):
        n = min(chunk, n_q - q0)
        if pass1 == "hopper":
            hopper_backward.launch_hopper_ds(q, kv, indices, n_keys, d_out, out, lse, d_lse, g,
                                             p_sums if probs_into is not None else None, q0, n, sm_scale)
        else:
            _sparse_mla_bwd_ds_kernel[(n_hb * n,)](
                q, kv, indices, n_keys, d_out, out, lse, dlse_arg, g, p_sums, T, S, K, H, d_v, d_tail, sm_scale,
                sm_scale * LOG2E, q0, n_hb,
                q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
                d_out.stride(0), d_out.stride(1), d_out.stride(2), out.stride(0), out.stride(1), out.stride(2),
                lse.stride(0), lse.stride(1), dlse_arg.stride(0), dlse_arg.stride(1), g.stride(0), g.stride(1),
                p_sums.stride(0), p_sums.stride(1),
                BLOCK_H=cfg["ds_BLOCK_H"], BLOCK_K=cfg["ds_BLOCK_K"], HAS_DLSE=d_lse is not None, **dims,
                SUM_P=probs_into is not None, num_warps=cfg["ds_num_warps"], num_stages=cfg["ds_num_stages"],
            )
        if probs_into is not None:
            _probs_into_kernel[(n,)](
                p_sums, n_keys, target, T, K, q0, n_hb, float(weight), p_sums.stride(0), p_sums.stride(1),
                target.stride(0), target.stride(1), BLOCK_K=cfg["probs_BLOCK_K"], num_warps=4,
            )
        _sparse_mla_bwd_dq_gemm_kernel[(n_hbg * n,)](
            g, kv, indices, n_keys, dq, T, S, K, H, d_v, d_tail, q0, n_hbg, g.stride(0), g.stride(1), kv.stride(0),
            kv.stride(1), indices.stride(0), indices.stride(1), q.stride(0), q.stride(1), q.stride(2),
            BLOCK_H=cfg["dqg_BLOCK_H"], BLOCK_K=cfg["dqg_BLOCK_K"], DS_BLOCK_K=cfg["ds_BLOCK_K"], **dims,
            num_warps=cfg["dqg_num_warps"], num_stages=cfg["dqg_num_stages"],
        )
        for col0, n_cols, block_n, n_j, warps in ((0, d_v, bn, 2 * H, cfg["gemm_num_warps"]),
                                                  (d_v, d_tail, bt, H, cfg["tail_num_warps"])):
            if n_cols == 0:
                continue
            n_nb = triton.cdiv(n_cols, block_n)
            _sparse_mla_bwd_dkv_gemm_kernel[(n_nb * n_kb * n,)](
                g, q, d_out, indices, n_keys, dkv_out, T, S, K, H, q0, col0, n_cols, n_j, n_nb, n_kb, *gs,
                BLOCK_K=bk, BLOCK_N=block_n, BLOCK_J=cfg["gemm_BLOCK_J"], DETERMINISTIC=deterministic,
                DOT_PREC=prec, DS_BLOCK_K=cfg["ds_BLOCK_K"], num_warps=warps, num_stages=cfg["gemm_num_stages"],
            )
        if deterministic:
            order, row_ptr = _csr_by_key_row(indices_flat, q0, n, T, S, B * S)
            _sparse_mla_bwd_dkv_reduce_kernel[(B * S,)](
                c_buf, order, row_ptr, dkv, D_qk, c_buf.stride(1), dkv.stride(1),
                BLOCK_E=cfg["red_BLOCK_E"], BLOCK_D=cfg["red_BLOCK_D"], num_warps=cfg["red_num_warps"],
            )
    return dq, dkv.to(kv.dtype)
