"""Exact causal top-k of fp32 score rows by radix select (no sort of the row), with the model's tie rule.

One program per score row [S] (one query). Scores are mapped to order-preserving 32-bit keys (-0.0 first made +0.0;
`o` = signed int whose order is the float order, `u` = o with the sign bit flipped, whose unsigned order is the
float order, so its top byte is the most significant radix digit). Per row, only the visible prefix [0, n) is read,
n = clamp(position + 1, 0, S), so the invisible part of the row need not be written at all.

  1. histogram of u's top byte over the row; the bucket holding the kk-th largest (kk = min(topk, n)) is found from
     the suffix counts;
  2. one compaction pass: keys in a higher bucket go straight to the output slots, keys in the threshold bucket go
     to a per-row candidate list (in ascending key index, so ties keep index order);
  3. up to three more histograms over the candidates only (next byte each, keys outside the threshold prefix
     masked) until the threshold is exact or every candidate in the prefix is needed;
  4. a pass over the candidates takes those above the threshold and the first `need` equal to it (lowest indices);
  5. the kk survivors are sorted in-kernel (bitonic `tl.sort` of int64 keys: score key << 32 | 2^31-1-index, so
     ties order by lower index) and written best first, -1 for -inf scores and for slots past kk.

This is exactly `naive.topk_from_scores`' order. Grid and buffers depend on shapes only; the per-row work depends on
positions read on the device, so the op is CUDA-graph safe. Typical rows read the scores twice from memory; rows of
massive exact ties (e.g. all-zero scores) make the candidate list as long as the row, which stays correct.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SIGN = tl.constexpr(-2147483648)  # 0x80000000 as int32
NEG_INF_ORDERED = tl.constexpr(-2139095041)  # the order-preserving int32 of -inf


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _threshold_bucket(hist, need, NB: tl.constexpr):
    """hist [NB] counts of one radix digit; need >= 1 <= sum(hist). -> (bucket b holding the need-th largest,
    count in buckets above b, count in b)."""
    bins = tl.arange(0, NB)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # count strictly above each bucket
    hit = (above < need) & (above + hist >= need)
    b = tl.max(tl.where(hit, bins, -1), 0)
    gt = tl.sum(tl.where(bins > b, hist, 0), 0)
    eq = tl.sum(tl.where(bins == b, hist, 0), 0)
    return b, gt, eq


@triton.jit
def _radix_topk_kernel(
    x_ptr, pos_ptr, cand_ptr, out_ptr,
    S, TOPK, ROWS_PER_B,
    s_xb, s_xt, s_pb, s_pt, s_cr, s_ob, s_ot,
    BLOCK: tl.constexpr, K_POW2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // ROWS_PER_B
    t = pid % ROWS_PER_B
    x_row = x_ptr + b * s_xb + t * s_xt
    o_row = out_ptr + b * s_ob + t * s_ot
    c_row = cand_ptr + pid * s_cr
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int32)
    n = tl.minimum(tl.maximum(pos + 1, 0), S)
    kk = tl.minimum(n, TOPK)
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    if kk > 0:
        # 1. histogram of the top byte; masked lanes land in bin 0 and are subtracted after the loop
        hist = tl.zeros([256], tl.int32)
        for s0 in range(0, n, BLOCK):
            idx = s0 + offs
            m = idx < n
            u = _ordered(tl.load(x_row + idx, mask=m, other=0.0)) ^ SIGN
            hist += tl.histogram(tl.where(m, (u >> 24) & 255, 0), 256)
        hist -= tl.where(bins == 0, tl.cdiv(n, BLOCK) * BLOCK - n, 0)
        b1, nsel, ncand = _threshold_bucket(hist, kk, 256)
        need = kk - nsel
        # 2. compaction: higher buckets -> output slots, the threshold bucket -> candidates (ascending index)
        n_out = nsel * 0
        n_c = nsel * 0
        for s0 in range(0, n, BLOCK):
            idx = s0 + offs
            m = idx < n
            d = ((_ordered(tl.load(x_row + idx, mask=m, other=0.0)) ^ SIGN) >> 24) & 255
            up = m & (d > b1)
            eq = m & (d == b1)
            c_up = tl.cumsum(up.to(tl.int32), 0)
            c_eq = tl.cumsum(eq.to(tl.int32), 0)
            tl.store(o_row + (n_out + c_up - 1), idx, mask=up)
            tl.store(c_row + (n_c + c_eq - 1), idx, mask=eq)
            n_out += tl.sum(up.to(tl.int32), 0)
            n_c += tl.sum(eq.to(tl.int32), 0)
        tl.debug_barrier()  # candidates written by other threads are read below
        # 3. refine the threshold byte by byte over the candidates only; stop once the whole prefix is needed
        prefix = b1 << 24  # determined high bits of u, in place
        n_match = ncand
        lo = ncand * 0 + 24  # number of undetermined low bits
        for level in tl.static_range(3):
            if need < n_match:
                shift = 16 - 8 * level
                hi_mask = ~((1 << lo) - 1)
                hist = tl.zeros([256], tl.int32)
                for c0 in range(0, n_c, BLOCK):
                    ci = c0 + offs
                    m = ci < n_c
                    sidx = tl.load(c_row + ci, mask=m, other=0)
                    u = _ordered(tl.load(x_row + sidx, mask=m, other=0.0)) ^ SIGN
                    match = m & ((u & hi_mask) == prefix)
                    hist += tl.histogram(tl.where(match, (u >> shift) & 255, 0), 256)
                    hist -= tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), 0), 0)
                bl, gt, eq_cnt = _threshold_bucket(hist, need, 256)
                prefix = prefix | (bl << shift)
                lo = shift
                need -= gt
                n_match = eq_cnt
        # 4. take candidates above the threshold prefix and the first `need` inside it
        hi_mask = ~((1 << lo) - 1)
        top_o = (prefix | ~hi_mask) ^ SIGN  # largest ordered key inside the prefix
        n_tie = n_out * 0
        for c0 in range(0, n_c, BLOCK):
            ci = c0 + offs
            m = ci < n_c
            sidx = tl.load(c_row + ci, mask=m, other=0)
            o = _ordered(tl.load(x_row + sidx, mask=m, other=0.0))
            match = m & (((o ^ SIGN) & hi_mask) == prefix)
            rank = n_tie + tl.cumsum(match.to(tl.int32), 0) - 1
            take = (m & (o > top_o)) | (match & (rank < need))
            c_take = tl.cumsum(take.to(tl.int32), 0)
            tl.store(o_row + (n_out + c_take - 1), sidx, mask=take)
            n_out += tl.sum(take.to(tl.int32), 0)
            n_tie += tl.sum(match.to(tl.int32), 0)
        tl.debug_barrier()  # the kk survivors were written by other threads
    # 5. sort the survivors best first (ties: lower index first) and pad with -1
    ks = tl.arange(0, K_POW2)
    live = ks < kk
    sidx = tl.load(o_row + ks, mask=live, other=0)
    o = _ordered(tl.load(x_row + sidx, mask=live, other=float("-inf")))
    key = (o.to(tl.int64) << 32) | (2147483647 - sidx).to(tl.int64)
    key = tl.where(live, key, -9223372036854775807 - 1)
    tl.debug_barrier()  # every survivor is loaded before slots are overwritten
    key = tl.sort(key, descending=True)
    best = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
    ok = (ks < kk) & ((key >> 32) > NEG_INF_ORDERED)
    tl.store(o_row + ks, tl.where(ok, best, -1), mask=ks < TOPK)


INT32_MIN = tl.constexpr(-2147483648)
INT64_MIN = tl.constexpr(-9223372036854775808)


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
def _sampled_topk_kernel(
    x_ptr, pos_ptr, cand_ptr, surv_ptr, out_ptr,
    S, TOPK, ROWS_PER_B,
    s_xb, s_xt, s_pb, s_pt, s_cr, s_sr, s_ob, s_ot,
    BLOCK: tl.constexpr, K_POW2: tl.constexpr, SAMPLE: tl.constexpr,
):
    """Sample-then-select: a floor from an evenly spaced sample of the row keeps ~1.5-2 topk candidates in one
    streaming pass (no histogram over the row), then the radix select runs on the candidates' int64 keys only."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // ROWS_PER_B
    t = pid % ROWS_PER_B
    x_row = x_ptr + b * s_xb + t * s_xt
    o_row = out_ptr + b * s_ob + t * s_ot
    c_row = cand_ptr + pid * s_cr
    v_row = surv_ptr + pid * s_sr
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int32)
    n = tl.minimum(tl.maximum(pos + 1, 0), S)
    kk = tl.minimum(n, TOPK)
    bins = tl.arange(0, 256)
    if kk > 0:
        # 1. floor = the r-th largest of SAMPLE evenly spaced scores, r chosen so that the row count above the floor
        #    is >= kk with high probability (a miss only costs a second pass); exact when the sample is the row
        m_eff = tl.minimum(n, SAMPLE)
        si = tl.arange(0, SAMPLE)
        sp = (si.to(tl.int64) * n // m_eff).to(tl.int32)
        sv = _ordered(tl.load(x_row + sp, mask=si < m_eff, other=0.0))
        sv = tl.sort(tl.where(si < m_eff, sv, INT32_MIN), descending=True)
        base = (kk * m_eff + n - 1) // n
        margin = tl.where(m_eff < n, (3.0 * tl.sqrt(base.to(tl.float32))).to(tl.int32) + 8, 0)
        r = base + margin
        floor = tl.sum(tl.where(si == r - 1, sv, 0), 0)
        floor = tl.where(r <= m_eff, floor, INT32_MIN)
        # 2. one streaming pass: candidates >= floor as int64 keys (a second pass with no floor if the sample missed)
        n_c = _compact_keys(x_row, c_row, n, floor, BLOCK)
        if n_c < kk:
            n_c = _compact_keys(x_row, c_row, n, INT32_MIN, BLOCK)
        tl.debug_barrier()  # candidates written by other threads are read below
        # 3. radix select on the candidates' score words, a byte per level, until the whole prefix is needed
        offs = tl.arange(0, BLOCK)
        need = kk
        n_match = n_c
        prefix = n_c * 0
        lo = n_c * 0 + 32
        for level in tl.static_range(4):
            if need < n_match:
                shift = 24 - 8 * level
                hist = tl.zeros([256], tl.int32)
                for c0 in range(0, n_c, BLOCK):
                    ci = c0 + offs
                    m = ci < n_c
                    u = (tl.load(c_row + ci, mask=m, other=0) >> 32).to(tl.int32) ^ SIGN
                    if level > 0:
                        m = m & ((u & ~((1 << (shift + 8)) - 1)) == prefix)
                    hist += tl.histogram(tl.where(m, (u >> shift) & 255, 0), 256)
                    hist -= tl.where(bins == 0, BLOCK - tl.sum(m.to(tl.int32), 0), 0)
                bl, gt, eq_cnt = _threshold_bucket(hist, need, 256)
                prefix = prefix | (bl << shift)
                lo = lo * 0 + shift
                need -= gt
                n_match = eq_cnt
        # 4. survivors: candidates above the prefix, then the first `need` inside it (ascending index = tie rule)
        hi_mask = tl.where(lo >= 32, 0, ~((1 << (lo & 31)) - 1))
        top_o = (prefix | ~hi_mask) ^ SIGN
        n_out = n_c * 0
        n_tie = n_c * 0
        for c0 in range(0, n_c, BLOCK):
            ci = c0 + offs
            m = ci < n_c
            key = tl.load(c_row + ci, mask=m, other=0)
            o = (key >> 32).to(tl.int32)
            match = m & (((o ^ SIGN) & hi_mask) == prefix)
            rank = n_tie + tl.cumsum(match.to(tl.int32), 0) - 1
            take = (m & (o > top_o)) | (match & (rank < need))
            tl.store(v_row + (n_out + tl.cumsum(take.to(tl.int32), 0) - 1), key, mask=take)
            n_out += tl.sum(take.to(tl.int32), 0)
            n_tie += tl.sum(match.to(tl.int32), 0)
        tl.debug_barrier()  # the kk survivors were written by other threads
    # 5. sort the survivors best first (ties: lower index first) and pad with -1
    ks = tl.arange(0, K_POW2)
    key = tl.load(v_row + ks, mask=ks < kk, other=INT64_MIN)
    key = tl.sort(tl.where(ks < kk, key, INT64_MIN), descending=True)
    best = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
    ok = (ks < kk) & ((key >> 32) > NEG_INF_ORDERED)
    tl.store(o_row + ks, tl.where(ok, best, -1), mask=ks < TOPK)


def select_config(S: int, topk: int, overrides: dict | None = None) -> dict:
    cfg = dict(algo="sample", BLOCK=min(1024, max(16, triton.next_power_of_2(S))), num_warps=4, SAMPLE=2048)
    cfg.update(overrides or {})
    return cfg


def select_scratch(rows: int, S: int, topk: int, device, algo: str = "sample") -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `radix_topk_triton` over up to `rows` rows (reusable across calls): candidates [rows, S] (int64
    keys for "sample", int32 indices for "scan") and survivors [rows, topk] int64."""
    cand = torch.empty(rows, max(S, 1), device=device, dtype=torch.int64 if algo == "sample" else torch.int32)
    return cand, torch.empty(rows, max(topk, 1), device=device, dtype=torch.int64)


def radix_topk_triton(
    scores: torch.Tensor, positions: torch.Tensor, topk: int, out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None, overrides: dict | None = None,
) -> torch.Tensor:
    """scores [B, T, S] fp32 (last dim contiguous; only [0, positions + 1) of each row is read), positions [B, T]
    int (< 0 = padding) -> int32 [B, T, topk]: best first, ties to the lower key index, -1 where the score is -inf
    or fewer than topk keys are visible. `out` may be a [B, T, topk] int32 view; `scratch` from `select_scratch`
    with at least B * T rows. overrides: algo "sample" (default: sampled floor, one streaming pass, radix on the
    candidates) or "scan" (histogram of the top byte over the whole row, then compaction), BLOCK, num_warps, SAMPLE."""
    B, T, S = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"radix_topk_triton needs fp32 scores with a contiguous last dim, got {scores.dtype} "
                         f"strides {scores.stride()}")
    if S >= 2**31 - 1:
        raise ValueError(f"radix_topk_triton: S={S} does not fit the int32 key index")
    cfg = select_config(S, topk, overrides)
    if out is None:
        out = torch.empty(B, T, topk, device=scores.device, dtype=torch.int32)
    cand, surv = scratch if scratch is not None else select_scratch(B * T, S, topk, scores.device, cfg["algo"])
    if cand.shape[0] < B * T or cand.shape[1] < S or surv.shape[1] < topk:
        raise ValueError(f"radix_topk_triton: scratch {tuple(cand.shape)}/{tuple(surv.shape)} too small for "
                         f"{B * T} rows x {S} keys, topk {topk}")
    if B * T == 0:
        return out
    common = dict(BLOCK=cfg["BLOCK"], K_POW2=max(16, triton.next_power_of_2(topk)), num_warps=cfg["num_warps"])
    if cfg["algo"] == "sample":
        _sampled_topk_kernel[(B * T,)](
            scores, positions, cand, surv, out,
            S, topk, T,
            scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1), cand.stride(0),
            surv.stride(0), out.stride(0), out.stride(1),
            SAMPLE=cfg["SAMPLE"], **common,
        )
    elif cfg["algo"] == "scan":
        _radix_topk_kernel[(B * T,)](
            scores, positions, cand, out,
            S, topk, T,
            scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1), cand.stride(0),
            out.stride(0), out.stride(1), **common,
        )
    else:
        raise ValueError(f"radix_topk_triton: algo must be 'sample' or 'scan', got {cfg['algo']!r}")
    return out
