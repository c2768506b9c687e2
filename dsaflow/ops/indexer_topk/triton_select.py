"""Exact causal top-k of fp32 score rows (one row = one query's scores over S keys), not a sort of the row.

Scores map to order-preserving int32 (-0.0 made +0.0 first), and a key is the int64 (ordered score << 32 |
2^31 - 1 - index): keys are distinct and their descending order is the model's order (ties to the lower key index);
the kk best come out in ascending key order, -1 after, exactly `naive.topk_from_scores`. Only each row's visible
prefix [0, n), n = clamp(position + 1, 0, S), is read, so the invisible part of the score row need not be written.
Three kernels:

  1. floor (one program per row): the r-th largest of SAMPLE evenly spaced scores (a radix select in registers),
     r chosen so that the row holds >= kk = min(topk, n) scores at or above it but for ~1e-6 of rows (on an H200
     bench, 1.2 kk candidates on average at 8K keys, 2.6 kk at 128K; exact when the sample is the whole row); also
     zeroes the row's candidate count;
  2. compact: one streaming pass writes the keys at or above the floor to the row's candidate list. With one
     program per row (prefill: many rows) a running count keeps them in index order without atomics; a few long
     rows (decode) are split over many programs that reserve slots with one atomic per block;
  3. finish (one program per row): a radix select on the candidate keys themselves (distinct, so the kk-th is
     exact after at most 8 byte levels and usually 2-3), then the kk survivors written in the candidates' index
     order (no sort; an in-register sort by index only where atomics reserved the slots). A row whose
     sample missed (fewer than kk candidates: rare) first takes every visible key as a candidate (`_refill_kernel`).

Grids and buffers depend on shapes only and nothing syncs with the host: the op is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .radix_bits import INT32_MAX, INT32_MIN, INT64_MIN, NEG_INF_ORDERED, SIGN, _ordered, _threshold_bucket


@triton.jit
def _compact_keys(x_row, c_row, n, floor, BLOCK: tl.constexpr):
    """Write the int64 key (ordered score << 32 | 2^31-1-index) of every s < n with ordered score >= floor to c_row,
    in ascending index order; return how many."""
    offs = tl.arange(0, BLOCK)
    count = n * 0
    for s0 in range(0, n, BLOCK):
        idx = s0 + offs
        m = idx < n
        o = _ordered(tl.load(x_row + idx, mask=m, other=0.0))
        keep = m & (o >= floor)
        slot = count + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(c_row + slot, (o.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64), mask=keep)
        count += tl.sum(keep.to(tl.int32), 0)
    return count


@triton.jit
def _key_threshold(c_row, n_c, kk, BLOCK: tl.constexpr):
    """The kk-th largest of the n_c distinct int64 keys in c_row (1 <= kk <= n_c; any order): exactly kk keys are >=
    the returned key. A radix select on the keys viewed unsigned, a byte per level from the top, that stops once the
    whole bucket is needed (its lowest possible key is then the threshold). Distinct keys make ties impossible."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    need = kk
    n_match = n_c
    prefix = (n_c * 0).to(tl.int64)  # the determined high bits of the unsigned view, in place
    for level in tl.static_range(8):
        if need < n_match:
            shift: tl.constexpr = 56 - 8 * level
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, n_c, BLOCK):
                ci = c0 + offs
                m = ci < n_c
                u = tl.load(c_row + ci, mask=m, other=0) ^ INT64_MIN
                if level > 0:
                    m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(tl.where(m, ((u >> shift) & 255).to(tl.int32), 0), 256)
                hist -= tl.where(bins == 0, BLOCK - tl.sum(m.to(tl.int32), 0), 0)  # masked lanes counted in bin 0
            b, gt, eq = _threshold_bucket(hist, need, 256)
            prefix = prefix | (b.to(tl.int64) << shift)
            need -= gt
            n_match = eq
    return prefix ^ INT64_MIN


@triton.jit
def _write_best(c_row, v_row, o_row, n_c, kk, TOPK, BLOCK: tl.constexpr, K_POW2: tl.constexpr,
                IN_ORDER: tl.constexpr):
    """The kk best of the n_c candidate keys in c_row -> their indices in o_row [TOPK], ascending, -inf ones dropped,
    -1 after. IN_ORDER: the candidates are in ascending index order (one compaction program per row), so the
    survivors are written straight out in order; otherwise (slots reserved by atomics: decode) they go to v_row
    (int32 [>= kk]) and are sorted by index."""
    thr = _key_threshold(c_row, n_c, kk, BLOCK)
    offs = tl.arange(0, BLOCK)
    dst = o_row if IN_ORDER else v_row
    n_out = n_c * 0
    for c0 in range(0, n_c, BLOCK):
        ci = c0 + offs
        key = tl.load(c_row + ci, mask=ci < n_c, other=INT64_MIN)
        take = (ci < n_c) & (key >= thr) & ((key >> 32) > NEG_INF_ORDERED)
        idx = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
        tl.store(dst + n_out + tl.cumsum(take.to(tl.int32), 0) - 1, idx, mask=take)
        n_out += tl.sum(take.to(tl.int32), 0)
    if IN_ORDER:
        for p0 in range(n_out, TOPK, BLOCK):
            tl.store(o_row + p0 + offs, -1, mask=p0 + offs < TOPK)
    else:
        tl.debug_barrier()  # the survivors were written by other threads
        ks = tl.arange(0, K_POW2)
        idx = tl.sort(tl.load(v_row + ks, mask=ks < n_out, other=INT32_MAX))
        tl.store(o_row + ks, tl.where(ks < n_out, idx, -1), mask=ks < TOPK)


@triton.jit
def _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // ROWS_PER_B
    t = pid % ROWS_PER_B
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int32)
    n = tl.minimum(tl.maximum(pos + 1, 0), S)
    return pid, b, t, x_ptr + b * s_xb + t * s_xt, n, tl.minimum(n, TOPK)


@triton.jit
def _floor_kernel(x_ptr, pos_ptr, floor_ptr, count_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt,
                  SAMPLE: tl.constexpr):
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    n1 = tl.maximum(n, 1)
    m_eff = tl.minimum(n1, SAMPLE)
    si = tl.arange(0, SAMPLE)
    bins = tl.arange(0, 256)
    sp = (si.to(tl.int64) * n1 // m_eff).to(tl.int32)
    valid = si < tl.minimum(n, SAMPLE)
    u = _ordered(tl.load(x_row + sp, mask=valid, other=0.0)) ^ SIGN  # unsigned view of the ordered scores
    base = (kk * m_eff + n1 - 1) // n1  # the kk-th of the row sits near this rank of the sample
    # ~4 standard deviations of the sampled count above the kk-th plus 8: a row misses (fewer than kk candidates)
    # with probability ~1e-6, not ~3e-4 as with 2.5 sd + 4, where about one row in a 2048-row chunk missed, and its
    # whole-row refill and finish (one program each) set the select's time
    r = base + tl.where(m_eff < n1, (4.0 * tl.sqrt(base.to(tl.float32))).to(tl.int32) + 8, 0)
    # radix select of the r-th largest sample (a byte per level, in registers); stopping early leaves the floor at
    # the bottom of the bucket holding it, which the sample puts no score between
    need = r
    n_match = tl.minimum(n, SAMPLE)
    prefix = r * 0
    for level in tl.static_range(4):
        if need < n_match:
            shift: tl.constexpr = 24 - 8 * level
            m = valid
            if level > 0:
                m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist = tl.histogram(tl.where(m, (u >> shift) & 255, 0), 256)
            hist -= tl.where(bins == 0, SAMPLE - tl.sum(m.to(tl.int32), 0), 0)
            bl, gt, eq = _threshold_bucket(hist, need, 256)
            prefix = prefix | (bl << shift)
            need -= gt
            n_match = eq
    tl.store(floor_ptr + pid, tl.where((kk > 0) & (r <= m_eff), prefix ^ SIGN, INT32_MIN))
    tl.store(count_ptr + pid, 0)


@triton.jit
def _compact_kernel(x_ptr, pos_ptr, floor_ptr, count_ptr, cand_ptr, S, TOPK, ROWS_PER_B,
                    s_xb, s_xt, s_pb, s_pt, s_cr, SEG, BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr):
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    floor = tl.load(floor_ptr + pid)
    if ONE_SPLIT:  # one program per row: a running count in registers, no atomics, candidates in index order
        tl.store(count_ptr + pid, _compact_keys(x_row, cand_ptr + pid * s_cr, n, floor, BLOCK))
        return
    lo = tl.program_id(1) * SEG
    hi = tl.minimum(lo + SEG, n)
    offs = tl.arange(0, BLOCK)
    for s0 in range(lo, hi, BLOCK):
        idx = s0 + offs
        m = idx < hi
        o = _ordered(tl.load(x_row + idx, mask=m, other=0.0))
        keep = m & (o >= floor)
        cnt = tl.sum(keep.to(tl.int32), 0)
        slot0 = tl.atomic_add(count_ptr + pid, cnt, mask=cnt > 0)
        slot = slot0 + tl.cumsum(keep.to(tl.int32), 0) - 1
        key = (o.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)
        tl.store(cand_ptr + pid * s_cr + slot, key, mask=keep)


@triton.jit
def _refill_kernel(x_ptr, pos_ptr, count_ptr, cand_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt, s_cr,
                   BLOCK: tl.constexpr):
    """A row whose sample's floor was too high (fewer than kk candidates: rare) takes every visible key instead.
    Its own kernel, so the finish kernel carries no whole-row compaction code (registers, shared memory)."""
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    if tl.load(count_ptr + pid) < kk:
        tl.store(count_ptr + pid, _compact_keys(x_row, cand_ptr + pid * s_cr, n, INT32_MIN, BLOCK))


@triton.jit
def _finish_kernel(x_ptr, pos_ptr, count_ptr, cand_ptr, surv_ptr, out_ptr, S, TOPK, ROWS_PER_B,
                   s_xb, s_xt, s_pb, s_pt, s_cr, s_sr, s_ob, s_ot, BLOCK: tl.constexpr, K_POW2: tl.constexpr,
                   IN_ORDER: tl.constexpr):
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    _write_best(cand_ptr + pid * s_cr, surv_ptr + pid * s_sr, out_ptr + b * s_ob + t * s_ot, tl.load(count_ptr + pid),
                kk, TOPK, BLOCK, K_POW2, IN_ORDER)


def select_config(S: int, overrides: dict | None = None) -> dict:
    """Shape-only defaults. BLOCK: the compaction's block; BLOCK_FINISH: the finish's; SAMPLE: the floor's sample;
    whole_row=True skips the floor (every visible key is a candidate: the path a missed sample takes, for tests and
    benchmarks); programs: the compaction's target program count (None: 4 per SM). Unknown keys are refused.
    A one-warp compaction (its prefix sum needs no barrier across warps) of 512-key blocks, SAMPLE 1024 and a
    4-warp finish of 512-key blocks were the fastest on an H200 at 8K-128K keys (docs/kernels.md)."""
    p2 = max(16, triton.next_power_of_2(S))
    cfg = dict(BLOCK=min(512, p2), BLOCK_FINISH=min(512, p2), SAMPLE=min(1024, p2), whole_row=False, warps_floor=4,
               warps_compact=1, warps_finish=4, programs=None)
    unknown = set(overrides or {}) - set(cfg)
    if unknown:
        raise ValueError(f"radix_topk_triton: unknown config keys {sorted(unknown)} (known: {sorted(cfg)})")
    cfg.update(overrides or {})
    return cfg


def select_scratch(rows: int, S: int, topk: int, device) -> dict:
    """Scratch for `radix_topk_triton` over up to `rows` rows, reusable across calls: int64 candidate keys
    [rows, S], int32 survivor indices [rows, topk] (sorted by index where the candidates arrive
    out of order), int32 floors and counts [rows]."""
    return dict(cand=torch.empty(rows, max(S, 1), device=device, dtype=torch.int64),
                surv=torch.empty(rows, max(topk, 1), device=device, dtype=torch.int32),
                floor=torch.empty(rows, device=device, dtype=torch.int32),
                count=torch.empty(rows, device=device, dtype=torch.int32))


def _splits(rows: int, S: int, block: int, programs: int | None, device) -> int:
    """Programs per row for the compaction pass (shape-only): enough rows x splits to fill the GPU ~4 times."""
    if programs is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        programs = 4 * sms
    return max(1, min(triton.cdiv(programs, rows), triton.cdiv(S, block), 65535))


def radix_topk_triton(
    scores: torch.Tensor, positions: torch.Tensor, topk: int, out: torch.Tensor | None = None,
    scratch: dict | None = None, overrides: dict | None = None,
) -> torch.Tensor:
    """scores [B, T, S] fp32 (last dim contiguous; only [0, positions + 1) of each row is read), positions [B, T]
    int (< 0 = padding) -> int32 [B, T, topk]: the best keys in ascending key order, ties to the lower key index,
    -1 after them where the score is -inf or fewer than topk keys are visible. `out` may be a [B, T, topk] int32
    view; `scratch` from `select_scratch` with at least B * T rows. overrides: see `select_config` (BLOCK,
    BLOCK_FINISH, SAMPLE, whole_row, warps, programs)."""
    B, T, S = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"radix_topk_triton needs fp32 scores with a contiguous last dim, got {scores.dtype} "
                         f"strides {scores.stride()}")
    if S >= 2**31 - 1 or topk < 1:
        raise ValueError(f"radix_topk_triton: S={S} must fit the int32 key index and topk={topk} be >= 1")
    cfg = select_config(S, overrides)
    if out is None:
        out = torch.empty(B, T, topk, device=scores.device, dtype=torch.int32)
    rows = B * T
    sc = scratch if scratch is not None else select_scratch(rows, S, topk, scores.device)
    if sc["cand"].shape[0] < rows or sc["cand"].shape[1] < S or sc["surv"].shape[1] < topk:
        raise ValueError(f"radix_topk_triton: scratch {tuple(sc['cand'].shape)} / {tuple(sc['surv'].shape)} too "
                         f"small for {rows} rows x {S} keys, topk {topk}")
    if rows == 0:
        return out
    k_pow2 = max(16, triton.next_power_of_2(topk))
    row_args = (S, topk, T, scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1))
    if cfg["whole_row"]:
        sc["floor"][:rows].fill_(-2**31)
        sc["count"][:rows].zero_()
    else:
        _floor_kernel[(rows,)](scores, positions, sc["floor"], sc["count"], *row_args, SAMPLE=cfg["SAMPLE"],
                               num_warps=cfg["warps_floor"])
    splits = _splits(rows, S, cfg["BLOCK"], cfg["programs"], scores.device)
    seg = triton.cdiv(triton.cdiv(S, splits), cfg["BLOCK"]) * cfg["BLOCK"]
    _compact_kernel[(rows, splits)](scores, positions, sc["floor"], sc["count"], sc["cand"], *row_args,
                                    sc["cand"].stride(0), seg, BLOCK=cfg["BLOCK"], ONE_SPLIT=splits == 1,
                                    num_warps=cfg["warps_compact"])
    _refill_kernel[(rows,)](scores, positions, sc["count"], sc["cand"], *row_args, sc["cand"].stride(0),
                            BLOCK=cfg["BLOCK"], num_warps=cfg["warps_compact"])
    _finish_kernel[(rows,)](scores, positions, sc["count"], sc["cand"], sc["surv"], out, *row_args,
                            sc["cand"].stride(0), sc["surv"].stride(0), out.stride(0), out.stride(1),
                            BLOCK=cfg["BLOCK_FINISH"], K_POW2=k_pow2, IN_ORDER=splits == 1,
                            num_warps=cfg["warps_finish"])
    return out
