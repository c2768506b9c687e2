"""Triton dense indexer KL: the V3.2 dense warm-up loss, streamed over key blocks, never a [T, S] tensor.

Three kernels, each program owning BLOCK_T queries of one sequence and looping over the causal key blocks:
1. `_attn_lse_kernel` (one program per query block and per (layer, head)): flash-style online logsumexp of every
   served layer's attention row, stored in base 2 ([L, B, H, T] fp32). SDPA does not return it.
2. `_kl_fwd_kernel`: per key block, the target tile pbar = sum_{l,h} exp2(s*scale*log2e - lse2) / (L*H) (recomputed
   from q.k: the head-summed, L1-normalised, layer-averaged attention) and the index tile I; accumulates
   sum pbar*log(pbar), sum pbar*I and an online logsumexp of I. KL_t = sum pbar log pbar - sum pbar*I + LSE_I.
3. `_kl_bwd_kernel`: recomputes pbar and I per key block, dI = (exp(I - LSE_I) - pbar) * coef_t
   (coef_t = dLoss / n_valid for a valid query, else 0), then per index head j: G = dI * w_j * [q_j.k > 0];
   dq_j += G @ k (the program owns these rows: read-modify-write in fp32, no atomics), dw_j += sum_s dI * relu(q_j.k)
   (registers), dk += G^T @ q_j summed over heads in registers, then one fp32 atomic add per key block.
Dots take the inputs' dtype (bf16 on the model's path) and accumulate in fp32; fp32 inputs use IEEE dots.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _pos_block(pos_ptr, b, s_pb, s_pt, T, S, BLOCK_T: tl.constexpr):
    """The query block's rows, their positions, and how many keys the block can see at most (the loop bound)."""
    # Reversed: the last query blocks see the most keys, so they start first and the causal tail stays short.
    offs_t = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    pos = tl.load(pos_ptr + b * s_pb + offs_t * s_pt, mask=t_ok, other=-1)
    hi = tl.minimum(tl.max(pos, 0) + 1, S).to(tl.int32)
    return offs_t, t_ok, pos, hi


@triton.jit
def _attn_scores(q_base, k_base, offs_t, t_ok, offs_s, s_ok, D, s_qt, s_ks,
                 BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Raw scores q[t] . k[s] of one head: [BLOCK_T, BLOCK_S] fp32 (D in chunks of BLOCK_D: 192 = 3 x 64)."""
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = d0 + offs_d < D
        # int64 row offsets: T * H * D passes 2^31 elements at 128K context
        qa = tl.load(q_base + offs_t.to(tl.int64)[:, None] * s_qt + (d0 + offs_d)[None, :],
                     mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        ka = tl.load(k_base + offs_s.to(tl.int64)[None, :] * s_ks + (d0 + offs_d)[:, None],
                     mask=s_ok[None, :] & d_ok[:, None], other=0.0)
        acc = tl.dot(qa, ka, acc, input_precision=PREC)
    return acc


@triton.jit
def _target_tile(q_ptr, k_ptr, lse_ptr, b, offs_t, t_ok, offs_s, s_ok, visible, L, H, D,
                 s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_ll, s_lb, s_lh, scale2, inv_lh,
                 BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """pbar tile [BLOCK_T, BLOCK_S] fp32: mean over (layer, head) of the attention probs, 0 where invisible."""
    p = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for lh in range(L * H):
        l = (lh // H).to(tl.int64)
        h = lh % H
        s = _attn_scores(q_ptr + l * s_ql + b * s_qb + h * s_qh, k_ptr + l * s_kl + b * s_kb + h * s_kh,
                         offs_t, t_ok, offs_s, s_ok, D, s_qt, s_ks, BLOCK_T, BLOCK_S, BLOCK_D, PREC)
        lse2 = tl.load(lse_ptr + l * s_ll + b * s_lb + h * s_lh + offs_t, mask=t_ok, other=0.0)
        p += tl.exp2(s * scale2 - lse2[:, None])
    return tl.where(visible, p * inv_lh, 0.0)


@triton.jit
def _index_tile(qi_ptr, w_ptr, kiT, b, offs_t, t_ok, HI, DI, s_qib, s_qit, s_qih, s_wb, s_wt, s_wh,
                BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DI: tl.constexpr, PREC_I: tl.constexpr):
    """I tile [BLOCK_T, BLOCK_S] fp32 = sum_j w_j * relu(q_j . k), kiT [BLOCK_DI, BLOCK_S] already loaded."""
    offs_di = tl.arange(0, BLOCK_DI)
    q_rows = qi_ptr + b * s_qib + offs_t[:, None] * s_qit + offs_di[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for j in range(HI):
        qj = tl.load(q_rows + j * s_qih, mask=t_ok[:, None] & (offs_di < DI)[None, :], other=0.0)
        wj = tl.load(w_ptr + b * s_wb + offs_t * s_wt + j * s_wh, mask=t_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.dot(qj, kiT, input_precision=PREC_I), 0.0) * wj[:, None]
    return acc


@triton.jit
def _attn_lse_kernel(
    q_ptr, k_ptr, pos_ptr, lse_ptr,
    T, S, H, D,
    s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_pb, s_pt, s_ll, s_lb, s_lh,
    scale2,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    lh = tl.program_id(1)
    l = (lh // H).to(tl.int64)
    h = lh % H
    b = tl.program_id(2).to(tl.int64)
    offs_t, t_ok, pos, hi = _pos_block(pos_ptr, b, s_pb, s_pt, T, S, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < S
        visible = (offs_s[None, :] <= pos[:, None]) & s_ok[None, :]
        s = _attn_scores(q_ptr + l * s_ql + b * s_qb + h * s_qh, k_ptr + l * s_kl + b * s_kb + h * s_kh,
                         offs_t, t_ok, offs_s, s_ok, D, s_qt, s_ks, BLOCK_T, BLOCK_S, BLOCK_D, PREC)
        s = tl.where(visible, s * scale2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0 / -inf
        acc = acc * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m = m_new
    lse2 = tl.where(acc > 0, m + tl.log2(tl.where(acc > 0, acc, 1.0)), 0.0)
    tl.store(lse_ptr + l * s_ll + b * s_lb + h * s_lh + offs_t, lse2, mask=t_ok)


@triton.jit
def _kl_fwd_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, w_ptr, pos_ptr, kl_ptr, lsei_ptr,
    T, S, L, H, D, HI, DI,
    s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_ll, s_lb, s_lh,
    s_qib, s_qit, s_qih, s_kib, s_kis, s_wb, s_wt, s_wh, s_pb, s_pt,
    scale2, inv_lh,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    PREC: tl.constexpr, PREC_I: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    offs_t, t_ok, pos, hi = _pos_block(pos_ptr, b, s_pb, s_pt, T, S, BLOCK_T)
    offs_di = tl.arange(0, BLOCK_DI)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK_T], tl.float32)
    plogp = tl.zeros([BLOCK_T], tl.float32)
    p_i = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < S
        visible = (offs_s[None, :] <= pos[:, None]) & s_ok[None, :]
        p = _target_tile(q_ptr, k_ptr, lse_ptr, b, offs_t, t_ok, offs_s, s_ok, visible, L, H, D,
                         s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_ll, s_lb, s_lh, scale2, inv_lh,
                         BLOCK_T, BLOCK_S, BLOCK_D, PREC)
        kiT = tl.load(ki_ptr + b * s_kib + offs_s[None, :] * s_kis + offs_di[:, None],
                      mask=s_ok[None, :] & (offs_di < DI)[:, None], other=0.0)
        idx = _index_tile(qi_ptr, w_ptr, kiT, b, offs_t, t_ok, HI, DI, s_qib, s_qit, s_qih, s_wb, s_wt, s_wh,
                          BLOCK_T, BLOCK_S, BLOCK_DI, PREC_I)
        plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 1)
        p_i += tl.sum(tl.where(visible, p * idx, 0.0), 1)
        idx = tl.where(visible, idx, float("-inf"))
        m_new = tl.maximum(m, tl.max(idx, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - m_safe) + tl.sum(tl.exp(idx - m_safe[:, None]), 1)
        m = m_new
    valid = (pos >= 0) & t_ok & (S > 0)
    lse_i = tl.where(z > 0, m + tl.log(tl.where(z > 0, z, 1.0)), 0.0)
    tl.store(kl_ptr + b * T + offs_t, tl.where(valid, plogp - p_i + lse_i, 0.0), mask=t_ok)
    tl.store(lsei_ptr + b * T + offs_t, lse_i, mask=t_ok)


@triton.jit
def _kl_bwd_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, w_ptr, pos_ptr, lsei_ptr, coef_ptr, dqi_ptr, dki_ptr, dw_ptr,
    T, S, L, H, D, HI, DI,
    s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_ll, s_lb, s_lh,
    s_qib, s_qit, s_qih, s_kib, s_kis, s_wb, s_wt, s_wh, s_pb, s_pt,
    scale2, inv_lh,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_HI: tl.constexpr, PREC: tl.constexpr, PREC_I: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    offs_t, t_ok, pos, hi = _pos_block(pos_ptr, b, s_pb, s_pt, T, S, BLOCK_T)
    offs_di = tl.arange(0, BLOCK_DI)
    di_ok = offs_di < DI
    offs_hi = tl.arange(0, BLOCK_HI)
    lse_i = tl.load(lsei_ptr + b * T + offs_t, mask=t_ok, other=0.0)
    coef = tl.load(coef_ptr + b * T + offs_t, mask=t_ok, other=0.0)
    q_rows = qi_ptr + b * s_qib + offs_t[:, None] * s_qit + offs_di[None, :]
    # dq_I [B, T, HI, DI] and dk_I [B, S, DI] are contiguous fp32 buffers (made by the launcher).
    dq_rows = dqi_ptr + (b * T + offs_t[:, None]) * (HI * DI) + offs_di[None, :]
    dw = tl.zeros([BLOCK_T, BLOCK_HI], tl.float32)
    for s0 in range(0, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < S
        visible = (offs_s[None, :] <= pos[:, None]) & s_ok[None, :]
        p = _target_tile(q_ptr, k_ptr, lse_ptr, b, offs_t, t_ok, offs_s, s_ok, visible, L, H, D,
                         s_ql, s_qb, s_qt, s_qh, s_kl, s_kb, s_ks, s_kh, s_ll, s_lb, s_lh, scale2, inv_lh,
                         BLOCK_T, BLOCK_S, BLOCK_D, PREC)
        kiT = tl.load(ki_ptr + b * s_kib + offs_s[None, :] * s_kis + offs_di[:, None],
                      mask=s_ok[None, :] & di_ok[:, None], other=0.0)
        idx = _index_tile(qi_ptr, w_ptr, kiT, b, offs_t, t_ok, HI, DI, s_qib, s_qit, s_qih, s_wb, s_wt, s_wh,
                          BLOCK_T, BLOCK_S, BLOCK_DI, PREC_I)
        d_idx = tl.where(visible, tl.exp(idx - lse_i[:, None]) - p, 0.0) * coef[:, None]
        dk = tl.zeros([BLOCK_S, BLOCK_DI], tl.float32)
        for j in range(HI):
            qj = tl.load(q_rows + j * s_qih, mask=t_ok[:, None] & di_ok[None, :], other=0.0)
            wj = tl.load(w_ptr + b * s_wb + offs_t * s_wt + j * s_wh, mask=t_ok, other=0.0).to(tl.float32)
            lj = tl.dot(qj, kiT, input_precision=PREC_I)
            dwj = tl.sum(d_idx * tl.maximum(lj, 0.0), 1)
            dw = tl.where(offs_hi[None, :] == j, dw + dwj[:, None], dw)
            g = tl.where(lj > 0, d_idx * wj[:, None], 0.0).to(qj.dtype)
            dq_ptrs = dq_rows + j * DI
            dq_mask = t_ok[:, None] & di_ok[None, :]
            dqj = tl.dot(g, tl.trans(kiT), input_precision=PREC_I)
            tl.store(dq_ptrs, tl.load(dq_ptrs, mask=dq_mask, other=0.0) + dqj, mask=dq_mask)
            dk = tl.dot(tl.trans(g), qj, dk, input_precision=PREC_I)
        tl.debug_barrier()  # this block's dq stores are visible to every thread before the next block reads them
        tl.atomic_add(dki_ptr + (b * S + offs_s[:, None]) * DI + offs_di[None, :], dk,
                      mask=s_ok[:, None] & di_ok[None, :])
    tl.store(dw_ptr + (b * T + offs_t[:, None]) * HI + offs_hi[None, :], dw,
             mask=t_ok[:, None] & (offs_hi < HI)[None, :])
