"""Triton forward kernel for MQA-mode sparse MLA: one program per (head block, query, key split).

Every head of a query attends to the same K gathered latent rows, so a program holds BLOCK_H heads of one query and
streams the selected rows in blocks of BLOCK_K: each row block is loaded once ([BLOCK_K, d_v] + [BLOCK_K, tail]) and
feeds both dots (S = Q.K^T split as value part + rope tail, then acc += P.V with V = the value part of the same tile).
Online softmax in base 2. Invalid indices (-1 or >= S) are masked branchlessly: their rows are not read and their
scores are -inf. A query with no valid key writes out = 0 and lse = -inf.

Each program stops its key loop at its query's key extent n_keys[b, t] = 1 + the last slot holding a valid index (0
if none; `key_extent`, computed once per call by a small kernel, no host sync): the top-k op returns each query's keys
in ascending key order and pads with -1, so in causal training query t < topk has only t + 1 keys (a quarter of the
slots at 4096 tokens and topk 2048). Invalid slots before the extent are still masked, so any placement of -1 is
correct.

The key range can be split across programs (flash-decoding): each split writes its normalised partial output and
lse in fp32, and `triton_decode` merges them. With one split the kernel writes out/lse directly.

The grid is one-dimensional (CUDA limits grid axes 1 and 2 to 65,535, and B*T reaches 2^20 queries in long-context
prefill): program id -> (head block, query, split) with the head block fastest, so the head blocks of one query run
back to back and share its gathered rows in L2. Program ids and every offset derived from them are int64.
fp32 inputs use IEEE fp32 dots (Triton's default for fp32 would be TF32); bf16/fp16 inputs use the tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _sparse_mla_key_extent_kernel(idx_ptr, nk_ptr, T, S, K, s_ib, s_it, BLOCK: tl.constexpr):
    """One program per query (1-D grid over B*T): nk[b * T + t] = 1 + the last slot of indices[b, t] holding a
    valid index (0 <= index < S), 0 if none."""
    pid = tl.program_id(0).to(tl.int64)
    base = idx_ptr + (pid // T) * s_ib + (pid % T) * s_it
    ext = tl.zeros([BLOCK], tl.int32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        idx = tl.load(base + offs, mask=offs < K, other=-1)
        ext = tl.maximum(ext, tl.where((idx >= 0) & (idx < S), offs + 1, 0))
    tl.store(nk_ptr + pid, tl.max(ext, 0))


def key_extent(indices: torch.Tensor, S: int) -> torch.Tensor:
    """indices [B, T, K] int32 (unit last stride) -> n_keys [B, T] int32: 1 + the last slot holding an index in
    [0, S), 0 where none. Every kernel of this op loops over slots [0, n_keys) only. One launch, grid B*T (shapes
    only, no host sync: CUDA-graph safe)."""
    B, T, K = indices.shape
    n_keys = torch.empty(B, T, device=indices.device, dtype=torch.int32)
    if B * T > 0:
        block = min(1024, max(16, triton.next_power_of_2(K)))
        _sparse_mla_key_extent_kernel[(B * T,)](indices, n_keys, T, S, K, indices.stride(0), indices.stride(1),
                                                BLOCK=block, num_warps=4)
    return n_keys


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, nk_ptr, out_ptr, lse_ptr, kvs_ptr, kvr_ptr,
    T, S, K, H, D_V, D_T, k_per_split, scale_log2, n_q, n_hb,
    s_qb, s_qt, s_qh,
    s_kvb, s_kvs,
    s_ksb, s_kss, s_krb, s_krs,
    s_ib, s_it,
    s_osplit, s_ob, s_ot, s_oh,
    s_lsplit, s_lb, s_lt,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, DOT_PREC: tl.constexpr, USE_EXTENT: tl.constexpr, KV_FP8: tl.constexpr,
    QB: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pid_h = (pid % n_hb).to(tl.int32)  # fastest: head blocks of one query run together and share rows in L2
    pid_q = (pid // n_hb) % n_q
    pid_s = (pid // (n_hb * n_q)).to(tl.int32)
    b = pid_q // T
    t = pid_q % T

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    q_rows = q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
    q_nope = tl.load(q_rows + offs_dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    if HAS_TAIL:
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_ok = offs_dt < D_T
        q_tail = tl.load(q_rows + D_V + offs_dt[None, :], mask=h_ok[:, None] & dt_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    kv_base = kv_ptr + b * s_kvb
    kvs_base = kvs_ptr + b * s_ksb  # KV_FP8 only: the rows' fp32 scales and bf16 rope parts
    kvr_base = kvr_ptr + b * s_krb
    idx_base = idx_ptr + b * s_ib + t * s_it
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # the split's slots (masks: a block never crosses a split)
    # no valid slot at or past the query's key extent (nk[b * T + t] <= K): splits that start there run no block
    if USE_EXTENT:
        k_end = tl.minimum(k_hi, tl.load(nk_ptr + pid_q))
    else:  # decode: every slot (nk_ptr unused)
        k_end = k_hi
    for k0 in range(k_lo, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < k_hi, other=-1)
        valid = (idx >= 0) & (idx < S)
        row_ids = tl.where(valid, idx, 0).to(tl.int64)[:, None]
        rows = kv_base + row_ids * s_kvs
        if KV_FP8:  # packed FP8 rows: e4m3 values times their block's fp32 scale, dequantized here in registers
            nope_ok = valid[:, None] & dv_ok[None, :]
            k8 = tl.load(rows + offs_dv[None, :], mask=nope_ok, other=0.0).to(tl.float32)
            scales = tl.load(kvs_base + row_ids * s_kss + (offs_dv // QB)[None, :], mask=nope_ok, other=0.0)
            k_nope = (k8 * scales).to(q_nope.dtype)  # [BK, DV]
        else:
            k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)  # [BK, DV]
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        if HAS_TAIL:
            if KV_FP8:  # the rope part stays bf16 in the packed row
                k_tail = tl.load(kvr_base + row_ids * s_krs + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :],
                                 other=0.0).to(q_tail.dtype)
            else:
                k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
            s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=DOT_PREC)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = out_ptr + pid_s.to(tl.int64) * s_osplit + b * s_ob + t * s_ot + offs_h[:, None] * s_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + pid_s.to(tl.int64) * s_lsplit + b * s_lb + t * s_lt + offs_h, lse, mask=h_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: IEEE for fp32 inputs (fp32 means fp32, not TF32), the tensor-core default else."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _rotated_blocks(query, n_k, BLOCK_K: tl.constexpr):
    """(blocks of BLOCK_K slots below the key extent n_k, the block a query's loop starts at and wraps around from;
    used by the backward's pass 1 and dq). The top-k op returns each query's keys in ascending order, so queries that
    run side by side would otherwise read the same rows at the same time (in causal training every query t < topk
    selects exactly [0, t]), and on an H200 those L2 bank collisions slowed the backward measurably.
    Depends on the query only, so the summation order is fixed run to run."""
    n_blk = tl.cdiv(n_k, BLOCK_K)
    return n_blk, (query % tl.maximum(n_blk, 1)).to(tl.int32)


def fp8_cache_views(kv: torch.Tensor, d_v: int, d_tail: int):
    """(values, scales, rope, block) the kernel reads: for a packed FP8 cache (serve.kv_dtype=fp8, uint8 rows of
    dsaflow.ops.kv_fp8) its e4m3 values [B, S, d_v], fp32 scales [B, S, d_v / block] and bf16 rope [B, S, d_tail],
    views of the cache, and its scale block; otherwise (kv, kv, kv, 0): the unused pointers are never read."""
    if kv.dtype != torch.uint8:
        return kv, kv, kv, 0
    from dsaflow.ops.kv_fp8 import fp8_format_of, fp8_row_views

    fmt = fp8_format_of(kv, d_v, d_tail)
    if fmt is None:
        raise ValueError(f"sparse MLA: a uint8 kv of {kv.shape[-1]} bytes per row is no FP8 cache of d_v={d_v} and "
                         f"rope {d_tail}")
    values, scales, rope = fp8_row_views(kv, fmt)
    return values, scales, rope if d_tail else scales, fmt.block


def fwd_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes and launch options for a shape. Deterministic in the shape (fixed grids for CUDA graphs)."""
    H = q.shape[2]
    cfg = dict(
        BLOCK_H=min(64, max(16, triton.next_power_of_2(H))),
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        BLOCK_K=min(64, max(16, triton.next_power_of_2(K))),
        num_warps=4,
        num_stages=2,
    )
    big = cfg["BLOCK_DV"] * cfg["BLOCK_H"] >= 64 * 256
    if big:  # the fp32 accumulator [64, 512] needs two warpgroups' registers
        cfg.update(num_warps=8, BLOCK_K=min(cfg["BLOCK_K"], 32 if q.element_size() > 2 else 64))
    if q.element_size() > 2:
        cfg.update(num_stages=1)
    cfg.update(overrides or {})
    return cfg


def launch_sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
    out: torch.Tensor, lse: torch.Tensor, num_splits: int = 1, overrides: dict | None = None,
    n_keys: torch.Tensor | None = None, use_extent: bool = True,
):
    """Fill out/lse for q [B, T, H, D_qk], kv [B, S, D_qk] (or a packed FP8 cache uint8 [B, S, nbytes],
    `fp8_cache_views`), indices [B, T, K] int32 (last dims contiguous).
    n_keys [B, T] int32 contiguous: `key_extent(indices, S)`, computed here when not given. use_extent=False loops
    over every slot and launches no extent kernel (decode: a few queries over a long cache, whose rows are full,
    where the extra launch and the dependent load would cost a large share of a ~0.1 ms call).

    num_splits == 1: out [B, T, H, d_v] (any float dtype), lse [B, T, H] fp32.
    num_splits > 1: out [num_splits, B, T, H, d_v] fp32 and lse [num_splits, B, T, H] fp32 hold per-split partials.
    Returns the launched compiled kernel (its n_regs / n_spills feed the benchmark's notes).
    """
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    d_tail = D_qk - d_v
    cfg = fwd_config(q, d_v, d_tail, K, overrides)
    kv, kv_scales, kv_rope, block = fp8_cache_views(kv, d_v, d_tail)
    if not use_extent:
        n_keys = indices  # a placeholder pointer, never read
    elif n_keys is None:
        n_keys = key_extent(indices, S)
    bk = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, num_splits), bk) * bk
    if num_splits == 1:
        s_o, s_l = (0,) + tuple(out.stride()[:3]), (0,) + tuple(lse.stride()[:2])
    else:
        s_o, s_l = tuple(out.stride()[:4]), tuple(lse.stride()[:3])
    n_hb = triton.cdiv(H, cfg["BLOCK_H"])
    grid = (n_hb * B * T * num_splits,)  # 1-D: axis 0 takes 2^31 - 1 programs
    return _sparse_mla_fwd_kernel[grid](
        q, kv, indices, n_keys, out, lse, kv_scales, kv_rope,
        T, S, K, H, d_v, d_tail, k_per_split, sm_scale * LOG2E, B * T, n_hb,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        kv_scales.stride(0), kv_scales.stride(1), kv_rope.stride(0), kv_rope.stride(1),
        indices.stride(0), indices.stride(1),
        *s_o, *s_l,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=bk, BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"],
        HAS_TAIL=d_tail > 0, DOT_PREC=dot_precision(q.dtype), USE_EXTENT=use_extent, KV_FP8=block > 0, QB=max(block, 1),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def sparse_mla_fwd_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, overrides: dict | None = None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill forward: q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int32 -> out [B, T, H, d_v] q.dtype,
    lse [B, T, H] fp32 (natural log). Inputs must have contiguous last dims (the dispatcher ensures it).
    n_keys [B, T] int32: `key_extent(indices, S)` if already computed (the backward reuses it)."""
    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    launch_sparse_mla_fwd(q, kv, indices, sm_scale, d_v, out, lse, 1, overrides, n_keys)
    return out, lse
