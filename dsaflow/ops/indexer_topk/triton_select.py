"""Exact causal top-k of fp32 score rows (one row = one query's scores over S keys), not a sort of the row.

Scores map to order-preserving int32 (-0.0 made +0.0 first), and a key is the int64 (ordered score << 32 |
2^31 - 1 - index): keys are distinct and their descending order is the model's order (best first, ties to the lower
key index), exactly `naive.topk_from_scores`. Only each row's visible prefix [0, n), n = clamp(position + 1, 0, S),
is read, so the invisible part of the score row need not be written. Rows up to 64K keys use one kernel
(`_scan_topk_kernel`: a radix select over the whole row, see its docstring); longer rows three ("sampled"):

  1. floor (one program per row): the r-th largest of SAMPLE evenly spaced scores, r chosen so that the row holds
     >= kk = min(topk, n) scores at or above it with high probability and about 1.3-1.6 kk on average (exact when
     the sample is the whole row); also zeroes the row's candidate count;
  2. compact (rows x splits programs): one streaming pass writes the keys at or above the floor to the row's
     candidate list (slots reserved with one atomic per block; splits spread a few long rows over the GPU: decode);
  3. finish (one program per row): if kk <= candidates <= CAP, one in-register bitonic sort of the candidate keys
     gives the answer. Otherwise (the sample missed, or massive exact ties put too many keys at the floor) the row
     is redone alone: ordered compaction of the whole visible row, then a radix select on the keys' score words, a
     byte per level (histograms, suffix counts) until the threshold is exact, the ties taken lowest index first,
     and a sort of the kk survivors.

Grids and buffers depend on shapes only and nothing syncs with the host: the op is CUDA-graph safe.
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
def _radix_finish(c_row, v_row, o_row, n_c, kk, TOPK, BLOCK: tl.constexpr, K_POW2: tl.constexpr):
    """The kk best of the n_c candidate keys in c_row (ascending index order) -> o_row, best first, -1 padded."""
    bins = tl.arange(0, 256)
    # a. radix select on the candidates' score words, a byte per level, until the whole prefix is needed
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
    # b. survivors: candidates above the prefix, then the first `need` inside it (ascending index = tie rule)
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
    # c. sort the survivors best first (ties: lower index first) and pad with -1
    ks = tl.arange(0, K_POW2)
    key = tl.load(v_row + ks, mask=ks < kk, other=INT64_MIN)
    key = tl.sort(tl.where(ks < kk, key, INT64_MIN), descending=True)
    best = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
    ok = (ks < kk) & ((key >> 32) > NEG_INF_ORDERED)
    tl.store(o_row + ks, tl.where(ok, best, -1), mask=ks < TOPK)


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
    sp = (si.to(tl.int64) * n1 // m_eff).to(tl.int32)
    sv = _ordered(tl.load(x_row + sp, mask=si < tl.minimum(n, SAMPLE), other=0.0))
    sv = tl.sort(tl.where(si < tl.minimum(n, SAMPLE), sv, INT32_MIN), descending=True)
    base = (kk * m_eff + n1 - 1) // n1  # the kk-th of the row sits near this rank of the sample
    r = base + tl.where(m_eff < n1, (2.5 * tl.sqrt(base.to(tl.float32))).to(tl.int32) + 4, 0)
    floor = tl.sum(tl.where(si == r - 1, sv, 0), 0)
    tl.store(floor_ptr + pid, tl.where((kk > 0) & (r <= m_eff), floor, INT32_MIN))
    tl.store(count_ptr + pid, 0)


@triton.jit
def _compact_kernel(x_ptr, pos_ptr, floor_ptr, count_ptr, cand_ptr, S, TOPK, ROWS_PER_B,
                    s_xb, s_xt, s_pb, s_pt, s_cr, SEG, BLOCK: tl.constexpr):
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    floor = tl.load(floor_ptr + pid)
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
def _finish_kernel(x_ptr, pos_ptr, count_ptr, cand_ptr, surv_ptr, out_ptr, S, TOPK, ROWS_PER_B,
                   s_xb, s_xt, s_pb, s_pt, s_cr, s_sr, s_ob, s_ot,
                   BLOCK: tl.constexpr, K_POW2: tl.constexpr, CAP: tl.constexpr):
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    c_row = cand_ptr + pid * s_cr
    o_row = out_ptr + b * s_ob + t * s_ot
    n_c = tl.load(count_ptr + pid)
    if (n_c >= kk) & (n_c <= CAP):  # the common case: sort the candidates, keep the first kk
        j = tl.arange(0, CAP)
        key = tl.load(c_row + j, mask=j < n_c, other=INT64_MIN)
        key = tl.sort(tl.where(j < n_c, key, INT64_MIN), descending=True)
        best = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
        ok = (j < kk) & ((key >> 32) > NEG_INF_ORDERED)
        tl.store(o_row + j, tl.where(ok, best, -1), mask=j < TOPK)
    else:  # redo this row alone: ordered compaction of the whole visible row, then the radix select
        n_c = _compact_keys(x_row, c_row, n, INT32_MIN, BLOCK)
        tl.debug_barrier()  # candidates written by other threads are read below
        _radix_finish(c_row, surv_ptr + pid * s_sr, o_row, n_c, kk, TOPK, BLOCK, K_POW2)


@triton.jit
def _scan_topk_kernel(
    x_ptr, pos_ptr, cand_ptr, out_ptr,
    S, TOPK, ROWS_PER_B,
    s_xb, s_xt, s_pb, s_pt, s_cr, s_ob, s_ot,
    BLOCK: tl.constexpr, K_POW2: tl.constexpr,
):
    """Rows up to ~64K keys: a histogram of the top byte over the whole visible row, a compaction pass (higher
    buckets -> out, the threshold bucket -> int32 candidate indices), byte-by-byte refinement over the candidates,
    the ties lowest index first, a sort of the kk survivors (gathered scores)."""
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


def select_config(S: int, overrides: dict | None = None) -> dict:
    """Shape-only defaults. algo "scan" (whole-row histogram) up to 64K keys, "sampled" beyond: on an H200 (2048-4096
    rows, topk 2048) scan took 1.31 / 2.87 / 4.5 ms at 8K / 32K / 128K keys and sampled 4.24 / 4.59 / 3.74 ms (its
    two in-register sorts cost ~1 us per row whatever S); 64K was not measured. Short rows get a sample and cap no
    wider than the row (never a fallback)."""
    p2 = max(16, triton.next_power_of_2(S))
    algo = "sampled" if S > 65536 else "scan"
    # sampled, sweep at 128K keys x 2048 rows: BLOCK 2048 3.51 ms (1024: 3.73, 512: 4.16), SAMPLE 2048 3.42 ms
    # (4096: 3.73), CAP 4096 (8192: 5.10; 2048, i.e. the radix fallback for nearly every row: 9.71), 4 warps to
    # compact and 8 to finish (alternatives 4-13 % slower); BLOCK 2048 with SAMPLE 2048 together was not timed.
    # scan: BLOCK 2048 with 8 warps (measured at 8K-128K; at 128K 1024 with 4 warps was 8 % faster)
    cfg = dict(algo=algo, BLOCK=min(2048, p2), SAMPLE=min(2048, p2), CAP=min(4096, p2), warps_floor=4,
               warps_compact=4, warps_finish=8, warps_scan=8, programs=None)
    cfg.update(overrides or {})
    return cfg


def select_scratch(rows: int, S: int, topk: int, device) -> dict:
    """Scratch for `radix_topk_triton` over up to `rows` rows, reusable across calls: int64 candidate keys
    [rows, S], int64 survivors [rows, topk], int32 floors and counts [rows]."""
    return dict(cand=torch.empty(rows, max(S, 1), device=device, dtype=torch.int64),
                surv=torch.empty(rows, max(topk, 1), device=device, dtype=torch.int64),
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
    int (< 0 = padding) -> int32 [B, T, topk]: best first, ties to the lower key index, -1 where the score is -inf
    or fewer than topk keys are visible. `out` may be a [B, T, topk] int32 view; `scratch` from `select_scratch`
    with at least B * T rows. overrides: see `select_config` (algo, BLOCK, SAMPLE, CAP, warps, programs)."""
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
    if cfg["algo"] == "scan":
        cand = sc["cand"].view(torch.int32)  # int32 candidate indices: the int64 buffer holds two per key
        _scan_topk_kernel[(rows,)](
            scores, positions, cand, out, S, topk, T,
            scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1), cand.stride(0),
            out.stride(0), out.stride(1), BLOCK=cfg["BLOCK"], K_POW2=k_pow2, num_warps=cfg["warps_scan"],
        )
        return out
    if cfg["algo"] != "sampled":
        raise ValueError(f"radix_topk_triton: algo must be 'scan' or 'sampled', got {cfg['algo']!r}")
    row_args = (S, topk, T, scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1))
    _floor_kernel[(rows,)](scores, positions, sc["floor"], sc["count"], *row_args, SAMPLE=cfg["SAMPLE"],
                           num_warps=cfg["warps_floor"])
    splits = _splits(rows, S, cfg["BLOCK"], cfg["programs"], scores.device)
    seg = triton.cdiv(triton.cdiv(S, splits), cfg["BLOCK"]) * cfg["BLOCK"]
    _compact_kernel[(rows, splits)](scores, positions, sc["floor"], sc["count"], sc["cand"], *row_args,
                                    sc["cand"].stride(0), seg, BLOCK=cfg["BLOCK"], num_warps=cfg["warps_compact"])
    _finish_kernel[(rows,)](scores, positions, sc["count"], sc["cand"], sc["surv"], out, *row_args,
                            sc["cand"].stride(0), sc["surv"].stride(0), out.stride(0), out.stride(1),
                            BLOCK=cfg["BLOCK"], K_POW2=k_pow2, CAP=max(cfg["CAP"], k_pow2),
                            num_warps=cfg["warps_finish"])
    return out
