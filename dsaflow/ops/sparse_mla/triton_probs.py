"""The indexer-loss target (`sparse_mla(..., probs_into=)`) from a pass of its own, for a backward that does not
return the attention probabilities (cuDNN-Frontend's; `function.py` runs this pass after it).

It adds weight * P_sum / total into target [B, T, K] fp32, with P = exp(q . k * sm_scale - lse) from the forward's
lse (natural log), P_sum its sum over the heads per slot and total the sum of P_sum over the slots: what dsaflow's
backward adds with `probs_into`, and what `indexer_loss.attention_target` computes (fp32 reference:
`indexer_loss.naive.attention_target_naive`). Two launches per query chunk:
  probs `_sparse_mla_probs_kernel` per (head block, query), head block fastest (`triton_backward._head_tile`): the
        backward's pass 1 without dO, dP and G: S^T = K.Q^T in blocks of BLOCK_K slots up to the query's key extent
        n_keys (`triton_prefill.key_extent`), in pass 1's rotated block order, P summed over its heads per slot to
        ps [n_hb, chunk, K] (slots at or past the extent's last block stay unwritten and are never read).
  add   `triton_probs_add._probs_into_kernel`, the kernel that adds dsaflow's backward's target, per query.
One writer per element, no atomics: deterministic. 2 H K d_qk FLOPs per query (S only: about a fifth of the
backward's 2 H K (3 d_qk + 2 d_v)). Invalid indices (-1, >= S) are not read and give P = 0; a query with no valid
key adds nothing. Off Hopper the tiles are pass 1's (`bwd_config`'s ds_*). The transposed dot sums each slot's
heads in another order than pass 1, so the two targets agree to rounding (about 1e-7 relative), not bit for bit.
Chunk counts, grids and buffers depend on shapes only (no host sync: CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backward import _head_tile, bwd_config
from .triton_prefill import LOG2E, _rotated_blocks, dot_precision, key_extent
from .triton_probs_add import _probs_into_kernel

_empty = torch.empty  # a hook: the tests NaN-poison the partial sums through it


@triton.jit
def _sparse_mla_probs_kernel(
    q_ptr, kv_ptr, idx_ptr, nk_ptr, lse_ptr, ps_ptr,
    T, S, K, H, D_V, D_T, scale_log2, q0, n_hb,
    s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_lb, s_lt, s_psh, s_psq,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_TAIL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (head block, query q0 + pid_l): ps[head block, pid_l, k] = sum over its heads of P[h, k] for
    the slot blocks below the query's key extent.
    Scores are computed transposed, S^T = K . Q^T [BLOCK_K, BLOCK_H], so that the sum over heads runs along each
    row of the dot's output (within a warp) instead of across warps: 1.26x faster on an H200 at DeepSeek shapes."""
    pid_l, b, t, offs_h, h_ok, offs_dv, dv_ok, offs_dt, dt_ok = _head_tile(
        q0, T, H, D_V, D_T, n_hb, BLOCK_H, BLOCK_DV, BLOCK_DT)
    q_cols = q_ptr + b * s_qb + t * s_qt + offs_h[None, :] * s_qh
    q_nope_t = tl.load(q_cols + offs_dv[:, None], mask=h_ok[None, :] & dv_ok[:, None], other=0.0)  # [DV, H]
    if HAS_TAIL:
        q_tail_t = tl.load(q_cols + D_V + offs_dt[:, None], mask=h_ok[None, :] & dt_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + b * s_lb + t * s_lt + offs_h, mask=h_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # base 2; every P is 0 where -inf
    kv_base = kv_ptr + b * s_kvb
    idx_base = idx_ptr + b * s_ib + t * s_it
    n_k = tl.load(nk_ptr + q0 + pid_l)  # no valid slot at or past it
    ps_row = ps_ptr + (tl.program_id(0).to(tl.int64) % n_hb) * s_psh + pid_l * s_psq
    n_blk, rot = _rotated_blocks(q0 + pid_l, n_k, BLOCK_K)
    for i in range(0, n_blk):
        offs_k = ((i + rot) % n_blk) * BLOCK_K + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = (idx >= 0) & (idx < S)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * s_kvs
        k_nope = tl.load(rows + offs_dv[None, :], mask=valid[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(k_nope, q_nope_t, input_precision=DOT_PREC)
        if HAS_TAIL:
            k_tail = tl.load(rows + D_V + offs_dt[None, :], mask=valid[:, None] & dt_ok[None, :], other=0.0)
            s = tl.dot(k_tail, q_tail_t, s, input_precision=DOT_PREC)
        p = tl.exp2(s * scale_log2 - lse2[None, :])
        p = tl.where(valid[:, None] & h_ok[None, :], p, 0.0)
        tl.store(ps_row + offs_k, tl.sum(p, 1), mask=offs_k < K)


def probs_config(q: torch.Tensor, d_v: int, d_tail: int, K: int, overrides: dict | None = None) -> dict:
    """Tiles of the probs pass: pass 1's (`bwd_config`; what fits there fits here, with no dO tile beside it), but
    128-head blocks of 32 keys on Hopper in bf16/fp16 at d_v >= 256 (DeepSeek shapes, swept), add_BLOCK_K of the adding kernel, and max_bytes,
    the budget of the partial sums ps that sets the query chunk (4 * n_hb * K bytes per query: 16 KiB at
    h128 and top-k 2048, so 16K queries per chunk)."""
    b = bwd_config(q, d_v, d_tail, K)
    cfg = dict(
        BLOCK_H=b["ds_BLOCK_H"], BLOCK_K=b["ds_BLOCK_K"], BLOCK_DV=b["BLOCK_DV"], BLOCK_DT=b["BLOCK_DT"],
        num_warps=b["ds_num_warps"], num_stages=b["ds_num_stages"], add_BLOCK_K=b["probs_BLOCK_K"], max_bytes=2**28,
    )
    if q.is_cuda and q.element_size() == 2 and b["BLOCK_DV"] >= 256 and torch.cuda.get_device_capability(q.device)[0] >= 9:
        # Swept on an H200 (h128, top-k 2048, last 2048 queries of 8K / 32K): one 128-head block gathers each key
        # tile once for all heads; 64-key tiles, 4 warps, one stage: 2.27 / 2.47 ms, against 2.87 / 3.06 with the
        # untransposed kernel's best tiles (32 keys, 8 warps, 2 stages) and 2.55 / 2.70 with 64-head blocks. The
        # [576, 128] q tile and a [64, 576] key tile take ~220 KiB of shared memory: Hopper's 227 KiB, not Ampere's.
        cfg.update(BLOCK_H=min(128, max(16, triton.next_power_of_2(q.shape[2]))), BLOCK_K=64, num_warps=4, num_stages=1)
    cfg.update(overrides or {})
    return cfg


def check_target(target: torch.Tensor, B: int, T: int, K: int) -> None:
    if target.shape != (B, T, K) or target.dtype != torch.float32 or target.stride(-1) != 1:
        raise ValueError(f"probs_into: target must be fp32 [B, T, K] = {(B, T, K)} with a unit last stride, got "
                         f"{target.dtype} {tuple(target.shape)} strides {target.stride()}")


@torch.no_grad()
def sparse_mla_probs_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float, d_v: int,
    probs_into: tuple[torch.Tensor, float], n_keys: torch.Tensor | None = None, overrides: dict | None = None,
) -> None:
    """q [B, T, H, D_qk], kv [B, S, D_qk] (same dtype), indices [B, T, K] int32 (-1 or >= S: no key), lse [B, T, H]
    fp32 natural log (the forward's), probs_into = (target [B, T, K] fp32 with unit last stride, weight): adds
    weight * each query's head-summed, L1-normalised attention probabilities over its slots into target.
    n_keys [B, T] int32 contiguous = `key_extent(indices, S)` (computed when not given). d_v only splits each row
    into the two dot operands (value part + rope tail, as the backward does); 0 <= D_qk - d_v <= 128."""
    target, weight = probs_into
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    check_target(target, B, T, K)
    if kv.dtype != q.dtype:
        raise ValueError(f"sparse_mla_probs_triton: q.dtype={q.dtype} != kv.dtype={kv.dtype} (the kernel dots them)")
    n_q = B * T
    if n_q == 0 or K == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    lse = lse.float()
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    if n_keys is None:
        n_keys = key_extent(indices, S)
    d_tail = D_qk - d_v
    cfg = probs_config(q, d_v, d_tail, K, overrides)
    n_hb = triton.cdiv(H, cfg["BLOCK_H"])
    chunk = max(1, min(n_q, cfg["max_bytes"] // (4 * n_hb * K)))
    ps = _empty(n_hb, chunk, K, device=q.device, dtype=torch.float32)
    for q0 in range(0, n_q, chunk):
        n = min(chunk, n_q - q0)
        _sparse_mla_probs_kernel[(n_hb * n,)](
            q, kv, indices, n_keys, lse, ps, T, S, K, H, d_v, d_tail, sm_scale * LOG2E, q0, n_hb,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
            lse.stride(0), lse.stride(1), ps.stride(0), ps.stride(1),
            BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K"], BLOCK_DV=cfg["BLOCK_DV"], BLOCK_DT=cfg["BLOCK_DT"],
            HAS_TAIL=d_tail > 0, DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        _probs_into_kernel[(n,)](
            ps, n_keys, target, T, K, q0, n_hb, float(weight), ps.stride(0), ps.stride(1),
            target.stride(0), target.stride(1), BLOCK_K=cfg["add_BLOCK_K"], num_warps=4,
        )
