"""Triton kernel for the indexer-loss target: head-summed, L1-normalised attention probs over each query's K keys.

One program per query. It holds BLOCK_H heads of the query at a time and streams the query's selected latent rows in
blocks of BLOCK_K (the sparse-MLA forward's tile: value part + rope tail), recomputes S = Q.K^T with the input dtype
in and fp32 out, and turns it into probs with the forward's lse: P[h, k] = exp(S[h, k] * scale - lse[h]). The
head-sum of P goes to a per-query scratch row (first head block stores, later ones add), together with its running
total; a last sweep over the row adds `weight * row / total` into the target. So no [T, K, D] tensor exists, the
scratch and the target are [B, T, K] fp32, and several layers (an F layer and the S layers it serves) accumulate into
one target buffer, one launch each. The normalisation divides by the recomputed total, exactly like the reference,
rather than by the head count, so an lse that is slightly off is normalised away.
Cost per query: 2 * H * K * D_qk FLOPs (the S = Q.K^T half of a sparse-MLA forward), no P.V.
Invalid indices (-1 or >= S) are masked branchlessly: their rows are not read and their probs are 0; a query with no
valid key gets an all-zero row (its lse is -inf).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def valid_extent(idx_base, K, S, BLOCK_F: tl.constexpr):
    """1 + the last position of a valid index in this query's row (0 if none). Top-k rows put their -1 padding
    last (early queries of a causal sequence see fewer than K keys), so the key loops stop there: at 4096 tokens
    and top-2048 this skips a quarter of the work. Correct for any row: nothing valid lies past the extent.
    BLOCK_F (up to 1024) entries per step: a few long steps, not K / BLOCK_K dependent round trips."""
    k_end = 0
    for k0 in range(0, K, BLOCK_F):
        offs_k = k0 + tl.arange(0, BLOCK_F)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        k_end = tl.maximum(k_end, tl.max(tl.where((idx >= 0) & (idx < S), offs_k + 1, 0), 0))
    return k_end


@triton.jit
def _attention_target_kernel(
    q_ptr, kv_ptr, idx_ptr, lse_ptr, p_ptr, out_ptr,
    T, S, K, H, D_V, D_T, scale_log2, weight,
    s_qb, s_qt, s_qh,
    s_kvb, s_kvs,
    s_ib, s_it,
    s_lb, s_lt,
    s_pb, s_pt,
    s_ob, s_ot,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, ACCUMULATE: tl.constexpr, PREC: tl.constexpr, BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_T
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    p_row = p_ptr + b * s_pb + t * s_pt
    total = tl.zeros([BLOCK_K], tl.float32)  # per-lane partial sums of the whole row; reduced once at the end
    k_end = valid_extent(idx_base, K, S, BLOCK_F)

    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        q_rows = q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh
        q_nope = tl.load(q_rows + offs_dv[None, :], mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
        if HAS_TAIL:
            q_tail = tl.load(q_rows + D_V + offs_dt[None, :], mask=h_ok[:, None] & dt_ok[None, :], other=0.0)
        lse = tl.load(lse_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # no key: every P is masked anyway
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            idx = tl.load(idx_base + offs_k, mask=k_ok, other=-1)
            valid = (idx >= 0) & (idx < S)
            rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
            k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
            s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PREC)
            if HAS_TAIL:
                k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
                s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=PREC)
            p = tl.exp2(s * scale_log2 - lse2[:, None])
            p = tl.where(h_ok[:, None] & valid[None, :], p, 0.0)
            ps = tl.sum(p, 0)  # [BLOCK_K]: this head block's share
            total += ps
            prev = tl.load(p_row + offs_k, mask=k_ok & (h0 > 0), other=0.0)
            tl.store(p_row + offs_k, prev + ps, mask=k_ok)
        tl.debug_barrier()  # the next pass reads what other threads of this program stored

    inv = weight / tl.maximum(tl.sum(total, 0), 1e-30)
    out_row = out_ptr + b * s_ob + t * s_ot
    for k0 in range(0, K, BLOCK_F):  # long steps: with one program per SM, short ones would be latency-bound
        offs_k = k0 + tl.arange(0, BLOCK_F)
        k_ok = offs_k < K
        val = tl.load(p_row + offs_k, mask=offs_k < k_end, other=0.0) * inv  # past the extent: probability 0
        if ACCUMULATE:
            val += tl.load(out_row + offs_k, mask=k_ok, other=0.0)
        tl.store(out_row + offs_k, val, mask=k_ok)


def target_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes for a shape (deterministic in the shape). At DeepSeek-V3.2 shapes (128 heads, 512 + 64, bf16) all
    128 heads share one pass over the rows (BLOCK_H 128, BLOCK_K 32, 8 warps), about 1.4x faster on an H200 than two
    64-head passes (BLOCK_K 64, 4 warps), which the other shapes use; BLOCK_K 128 does not fit in shared memory.
    fp32 inputs take smaller key blocks and one stage."""
    H = q.shape[2]
    half = q.element_size() <= 2
    block_dv = max(16, triton.next_power_of_2(d_v))
    cfg = dict(
        BLOCK_H=min(64, max(16, triton.next_power_of_2(H))),
        BLOCK_K=min(64 if half else 32, max(16, triton.next_power_of_2(K))),
        BLOCK_DV=block_dv,
        BLOCK_DT=max(16, triton.next_power_of_2(max(d_tail, 1))),
        BLOCK_F=row_block(K),
        num_warps=4,
        num_stages=2 if half else 1,
    )
    if half and H > 64 and block_dv >= 512:
        cfg.update(BLOCK_H=128, BLOCK_K=min(32, cfg["BLOCK_K"]), num_warps=8)
    cfg.update(overrides or {})
    return cfg


def launch_attention_target(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float, d_v: int,
    out: torch.Tensor, weight: float, accumulate: bool, overrides: dict | None = None,
):
    """out [B, T, K] fp32 (contiguous last dim) = (out if accumulate else 0) + weight * distribution.

    q [B, T, H, D_qk], kv [B, S, D_qk] (same dtype, contiguous last dims), indices [B, T, K] int32, lse [B, T, H] fp32.
    d_v only splits the row into two dot operands (value part + tail); any split gives the same answer."""
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    d_tail = D_qk - d_v
    cfg = target_config(q, d_v, d_tail, K, overrides)
    scratch = torch.empty(B, T, K, device=q.device, dtype=torch.float32) if accumulate else out
    return _attention_target_kernel[(B * T,)](
        q, kv, indices, lse, scratch, out,
        T, S, K, H, d_v, d_tail, sm_scale * LOG2E, weight,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1),
        scratch.stride(0), scratch.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"],
        HAS_TAIL=d_tail > 0, ACCUMULATE=accumulate, PREC=dot_precision(q), BLOCK_F=cfg["BLOCK_F"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def row_block(K: int) -> int:
    """Entries per step of the loops that only sweep a query's index / target row (no dots)."""
    return min(1024, max(16, triton.next_power_of_2(K)))


def dot_precision(x: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots: TF32 would round the scores by ~1e-3, more than the KL between the
    near-uniform distributions this target feeds. Half-precision inputs are exact products anyway."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def split_dims(d_qk: int) -> int:
    """The value / tail split used for a row of d_qk columns: the largest power of two <= d_qk (576 -> 512 + 64)."""
    return 1 << (d_qk.bit_length() - 1)


@torch.no_grad()
def attention_target_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float,
    out: torch.Tensor | None = None, weight: float = 1.0, overrides: dict | None = None,
) -> torch.Tensor:
    """Same contract as `dsaflow.ops.indexer_loss.attention_target` (CUDA or the Triton interpreter)."""
    if kv.dtype != q.dtype:
        raise ValueError(f"attention_target: q.dtype={q.dtype} != kv.dtype={kv.dtype} (the kernel dots them)")
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    lse = lse.float()
    B, T, _, D_qk = q.shape
    K = indices.shape[2]
    accumulate = out is not None
    if out is None:
        out = torch.empty(B, T, K, device=q.device, dtype=torch.float32)
    elif out.shape != (B, T, K) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"attention_target: out must be fp32 [B, T, K] = {(B, T, K)} with a contiguous last dim, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if B * T == 0 or K == 0:
        return out if accumulate else out.zero_()
    if kv.shape[1] == 0:  # no key at all: the distribution is all zeros
        return out if accumulate else out.zero_()
    launch_attention_target(q, kv, indices, lse, sm_scale, split_dims(D_qk), out, float(weight), accumulate,
                            overrides)
    return out
