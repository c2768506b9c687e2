"""Triton kernels for the indexer KL loss on the sparse path: forward (per-query KL) and backward (dq_I, dk_I, dw).

scores[t, k] = sum_j w[t, j] * relu(q_I[t, j] . k_I[idx[t, k]]) over the K selected keys of query t, and
KL_t = sum_k tgt * log tgt - sum_k tgt * (scores - LSE_t), LSE_t = logsumexp_k scores (valid keys only).
Forward: one program per query holds all H_I heads of q_I [H_I, D_I] and streams the selected k_I rows in blocks of
BLOCK_K: logits = q_I . rows^T (input dtype in, fp32 out), relu, weighted head sum, then per-lane online logsumexp
and the target sums; it writes KL_t, LSE_t and sum_k tgt (the target's mass on valid keys, normally 1) per query.
No score row is stored. Backward recomputes the logits per block and, with g = dLoss / n_valid:
  dscores = (mass * softmax - tgt) * g       (valid keys only)
  dlogits = w[j] * dscores * [logits > 0]
  dw[t, j] += sum_k relu(logits) * dscores   (registers)
  dq_I[t]  += dlogits . rows                  (registers, fp32 accumulate)
  dk_I[idx] += dlogits^T . q_I[t]             (fp32 atomics: a key row is selected by many queries)
FLOPs per query: forward 2 * H_I * K * D_I, backward 3x that. Invalid indices (-1 or >= S) are masked: rows not
read, score -inf, no gradient. A query with no valid key has KL 0 and is left out of the mean.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_target import dot_precision, row_block, valid_extent


@triton.jit
def _query_tile(q_ptr, w_ptr, b, t, H, D, s_qb, s_qt, s_qh, s_wb, s_wt, s_wh,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """q_I [BH, BD] of query (b, t) in its input dtype and w [BH] fp32 (0 on padded heads / dims)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + b * s_wb + t * s_wt + offs_h * s_wh, mask=h_ok, other=0.0).to(tl.float32)
    return q, w, offs_h, h_ok, offs_d, d_ok


@triton.jit
def _key_block(k_base, idx_base, tgt_row, q, w, k0, K, S, s_ks, offs_d, d_ok, BLOCK_K: tl.constexpr,
               PREC: tl.constexpr):
    """The k_I rows of keys k0 .. k0 + BLOCK_K: their indices, validity, rows [BK, BD], logits [BH, BK] fp32,
    scores [BK] (valid keys only matter) and target [BK] (0 on invalid keys)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K  # K = the row's valid extent here
    idx = tl.load(idx_base + offs_k, mask=k_ok, other=-1)
    valid = (idx >= 0) & (idx < S)
    safe = tl.where(valid, idx, 0).to(tl.int64)
    rows = tl.load(k_base + safe[:, None] * s_ks + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(rows), input_precision=PREC)
    scores = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    tgt = tl.load(tgt_row + offs_k, mask=k_ok & valid, other=0.0)
    return safe, valid, rows, logits, scores, tgt


@triton.jit
def _indexer_kl_fwd_kernel(
    q_ptr, k_ptr, w_ptr, idx_ptr, tgt_ptr, stats_ptr,
    T, S, K, H, D,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_wh, s_ib, s_it, s_tb, s_tt,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """stats [4, B * T] fp32: KL_t (0 without a valid key), LSE_t (0 then), target mass on valid keys, valid flag."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    q, w, offs_h, h_ok, offs_d, d_ok = _query_tile(q_ptr, w_ptr, b, t, H, D, s_qb, s_qt, s_qh, s_wb, s_wt, s_wh,
                                                   BLOCK_H, BLOCK_D)
    k_base = k_ptr + b * s_kb
    idx_base = idx_ptr + b * s_ib + t * s_it
    tgt_row = tgt_ptr + b * s_tb + t * s_tt
    # Per-lane accumulators, reduced once after the loop (no cross-thread reduction per block).
    m = tl.full([BLOCK_K], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_K], tl.float32)
    ts = tl.zeros([BLOCK_K], tl.float32)  # sum tgt * score
    tt = tl.zeros([BLOCK_K], tl.float32)  # sum tgt * log tgt
    mass = tl.zeros([BLOCK_K], tl.float32)
    k_end = valid_extent(idx_base, K, S, BLOCK_F)
    for k0 in range(0, k_end, BLOCK_K):
        safe, valid, rows, logits, scores, tgt = _key_block(k_base, idx_base, tgt_row, q, w, k0, k_end, S, s_ks,
                                                            offs_d, d_ok, BLOCK_K, PREC)
        s = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
        ts += tgt * tl.where(valid, scores, 0.0)
        tt += tl.where(tgt > 0.0, tgt * tl.log(tl.where(tgt > 0.0, tgt, 1.0)), 0.0)
        mass += tgt
    m_all = tl.max(m, 0)
    any_valid = m_all > float("-inf")
    m_all = tl.where(any_valid, m_all, 0.0)
    l_all = tl.sum(l * tl.exp(m - m_all), 0)
    lse = tl.where(any_valid, m_all + tl.log(tl.maximum(l_all, 1e-30)), 0.0)
    mass_all = tl.sum(mass, 0)
    kl = tl.where(any_valid, tl.sum(tt, 0) - tl.sum(ts, 0) + mass_all * lse, 0.0)
    n = tl.num_programs(0)  # B * T
    tl.store(stats_ptr + pid, kl)
    tl.store(stats_ptr + n + pid, lse)
    tl.store(stats_ptr + 2 * n + pid, mass_all)
    tl.store(stats_ptr + 3 * n + pid, tl.where(any_valid, 1.0, 0.0))


@triton.jit
def _indexer_kl_bwd_kernel(
    q_ptr, k_ptr, w_ptr, idx_ptr, tgt_ptr, stats_ptr, g_ptr, dq_ptr, dk_ptr, dw_ptr,
    T, S, K, H, D,
    s_qb, s_qt, s_qh, s_kb, s_ks, s_wb, s_wt, s_wh, s_ib, s_it, s_tb, s_tt,
    s_dqb, s_dqt, s_dqh, s_dkb, s_dks, s_dwb, s_dwt,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """dq [B, T, H, D] and dw [B, T, H] (their dtypes) written per query; dk [B, S, D] fp32 (zeroed) accumulated."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    n = tl.num_programs(0)
    q, w, offs_h, h_ok, offs_d, d_ok = _query_tile(q_ptr, w_ptr, b, t, H, D, s_qb, s_qt, s_qh, s_wb, s_wt, s_wh,
                                                   BLOCK_H, BLOCK_D)
    lse = tl.load(stats_ptr + n + pid)
    mass = tl.load(stats_ptr + 2 * n + pid)
    g = tl.load(g_ptr)  # dLoss / n_valid, on the device (no host sync)
    k_base = k_ptr + b * s_kb
    dk_base = dk_ptr + b * s_dkb
    idx_base = idx_ptr + b * s_ib + t * s_it
    tgt_row = tgt_ptr + b * s_tb + t * s_tt
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    k_end = valid_extent(idx_base, K, S, BLOCK_F)
    for k0 in range(0, k_end, BLOCK_K):
        safe, valid, rows, logits, scores, tgt = _key_block(k_base, idx_base, tgt_row, q, w, k0, k_end, S, s_ks,
                                                            offs_d, d_ok, BLOCK_K, PREC)
        p = tl.exp(tl.where(valid, scores - lse, float("-inf")))
        ds = tl.where(valid, (mass * p - tgt) * g, 0.0)  # [BK]
        dw += tl.sum(tl.maximum(logits, 0.0) * ds[None, :], 1)
        dlog = tl.where(logits > 0.0, w[:, None] * ds[None, :], 0.0).to(q.dtype)  # [BH, BK]
        dq = tl.dot(dlog, rows, dq, input_precision=PREC)
        dk = tl.dot(tl.trans(dlog), q, input_precision=PREC)  # [BK, BD] fp32
        tl.atomic_add(dk_base + safe[:, None] * s_dks + offs_d[None, :], dk, mask=valid[:, None] & d_ok[None, :],
                      sem="relaxed")
    tl.store(dq_ptr + b * s_dqb + t * s_dqt + offs_h[:, None] * s_dqh + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(dw_ptr + b * s_dwb + t * s_dwt + offs_h, dw.to(dw_ptr.dtype.element_ty), mask=h_ok)


def kl_config(q: torch.Tensor, K: int, overrides: dict | None = None, backward: bool = False) -> dict:
    """Block sizes (deterministic in the shape): all H_I heads in one tile, BLOCK_K keys per step, 4 warps; the
    forward takes 64 keys per step and the backward 32, the fastest of a sweep at V3.2 shapes on an H200 (more
    warps or larger key blocks spill or lose occupancy)."""
    H, D = q.shape[2], q.shape[3]
    half = q.element_size() <= 2
    cfg = dict(
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_K=min(32 if backward or not half else 64, max(16, triton.next_power_of_2(K))),
        BLOCK_F=row_block(K),
        num_warps=4,
        num_stages=2,
    )
    cfg.update(overrides or {})
    return cfg


def _strides(q, k, w, indices, target):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1), w.stride(2),
            indices.stride(0), indices.stride(1), target.stride(0), target.stride(1))


def launch_indexer_kl_fwd(q, k, w, indices, target, overrides=None, stats=None) -> torch.Tensor:
    """-> stats [4, B * T] fp32 (KL per query, LSE, target mass, valid flag). Inputs: last dims contiguous.
    `stats` may be a preallocated (e.g. NaN-poisoned, in tests) buffer; every element is written."""
    B, T, H, D = q.shape
    S, K = k.shape[1], indices.shape[2]
    cfg = kl_config(q, K, (overrides or {}).get("fwd"))
    if stats is None:
        stats = torch.empty(4, B * T, device=q.device, dtype=torch.float32)
    _indexer_kl_fwd_kernel[(B * T,)](
        q, k, w, indices, target, stats, T, S, K, H, D, *_strides(q, k, w, indices, target),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], BLOCK_D=cfg["BLOCK_D"], PREC=dot_precision(q),
        BLOCK_F=cfg["BLOCK_F"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return stats


def launch_indexer_kl_bwd(q, k, w, indices, target, stats, g, overrides=None, dq=None, dw=None):
    """g: fp32 [1] = dLoss / n_valid. -> dq (q.dtype), dk (k.dtype), dw (w.dtype). `dq` / `dw` may be preallocated
    (e.g. NaN-poisoned, in tests); every element is written. dk is accumulated into a zeroed fp32 buffer."""
    B, T, H, D = q.shape
    S, K = k.shape[1], indices.shape[2]
    cfg = kl_config(q, K, (overrides or {}).get("bwd"), backward=True)
    dq = torch.empty_like(q) if dq is None else dq
    dw = torch.empty(B, T, H, device=w.device, dtype=w.dtype) if dw is None else dw
    dk = torch.zeros(B, S, D, device=k.device, dtype=torch.float32)
    _indexer_kl_bwd_kernel[(B * T,)](
        q, k, w, indices, target, stats, g, dq, dk, dw, T, S, K, H, D, *_strides(q, k, w, indices, target),
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dw.stride(0), dw.stride(1),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], BLOCK_D=cfg["BLOCK_D"], PREC=dot_precision(q),
        BLOCK_F=cfg["BLOCK_F"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq, dk.to(k.dtype), dw
