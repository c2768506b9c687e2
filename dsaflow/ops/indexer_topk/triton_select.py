"""Exact causal top-k of fp32 score rows (one row = one query's scores over S keys), not a sort of the row.

Scores map to order-preserving int32 (-0.0 made +0.0 first), and a key is the int64 (ordered score << 32 |
2^31 - 1 - index): keys are distinct and their descending order is the model's order (ties to the lower key index);
the kk best come out in ascending key order, -1 after, exactly `naive.topk_from_scores`. Only each row's visible
prefix [0, n), n = clamp(position + 1, 0, S), is read, so the invisible part of the score row need not be written.
Three kernels:

  1. floor (one program per row): the r-th largest of SAMPLE evenly spaced scores (a radix select in registers),
     r chosen so that the row holds >= kk = min(topk, n) scores at or above it but for ~1e-6 of rows (on an H200
     bench, 1.2 kk candidates on average at 8K keys, 2.6 kk at 128K; exact when the sample is the whole row);
  2. compact: one streaming pass writes the keys at or above the floor to the row's candidate list, in index order.
     A row is cut into SPLITS segments of SEG scores, one program each (prefill, many rows: one segment; decode, a
     few long rows: enough segments to fill the GPU). With several segments a first pass counts each segment's
     candidates, and each segment then writes at the sum of the counts before it: no atomics, and the list comes
     out in index order;
  3. finish (one program per row): a radix select on the candidate keys themselves (distinct, so the kk-th is
     exact after at most 8 byte levels and usually 2-3), then the kk survivors written out in the list's order (no
     sort). A row whose sample missed (fewer than kk candidates: rare) first takes every visible key as a
     candidate (`_refill_kernel`).

Grids and buffers depend on shapes only and nothing syncs with the host: the op is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .radix_bits import INT32_MIN, INT64_MIN, NEG_INF_ORDERED, SIGN, _ordered, _threshold_bucket


@triton.jit
def _compact_keys(x_row, c_row, lo, hi, floor, BLOCK: tl.constexpr):
    """Write the int64 key (ordered score << 32 | 2^31-1-index) of every s in [lo, hi) with ordered score >= floor to
    c_row, in ascending index order; return how many."""
    offs = tl.arange(0, BLOCK)
    count = (hi - lo) * 0
    for s0 in range(lo, hi, BLOCK):
        idx = s0 + offs
        m = idx < hi
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
def _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // ROWS_PER_B
    t = pid % ROWS_PER_B
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int32)
    n = tl.minimum(tl.maximum(pos + 1, 0), S)
    return pid, b, t, x_ptr + b * s_xb + t * s_xt, n, tl.minimum(n, TOPK)


@triton.jit
def _counted(n_row, upto, SPLITS_POW2: tl.constexpr):
    """The sum of a row's first `upto` segment counts (upto <= SPLITS_POW2): where segment `upto` writes, or with
    upto = SPLITS the row's candidate count."""
    j = tl.arange(0, SPLITS_POW2)
    return tl.sum(tl.load(n_row + j, mask=j < upto, other=0), 0)


@triton.jit
def _floor_kernel(x_ptr, pos_ptr, floor_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt, SAMPLE: tl.constexpr):
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


@triton.jit
def _count_kernel(x_ptr, pos_ptr, floor_ptr, count_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt, SEG, SPLITS,
                  BLOCK: tl.constexpr):
    """Program (row, segment j), several segments per row: how many of the row's scores [j * SEG, (j + 1) * SEG)
    below its extent are at or above its floor."""
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    j = tl.program_id(1)
    floor = tl.load(floor_ptr + pid)
    offs = tl.arange(0, BLOCK)
    lo = j * SEG
    hi = tl.minimum(lo + SEG, n)
    count = (hi - lo) * 0
    for s0 in range(lo, hi, BLOCK):
        idx = s0 + offs
        m = idx < hi
        count += tl.sum((m & (_ordered(tl.load(x_row + idx, mask=m, other=0.0)) >= floor)).to(tl.int32), 0)
    tl.store(count_ptr + pid * SPLITS + j, count)


@triton.jit
def _compact_kernel(x_ptr, pos_ptr, floor_ptr, count_ptr, cand_ptr, S, TOPK, ROWS_PER_B,
                    s_xb, s_xt, s_pb, s_pt, s_cr, SEG, SPLITS, BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """Program (row, segment j): the candidates among the row's scores [j * SEG, (j + 1) * SEG) below its extent,
    written after those of the segments before it (their counts from `_count_kernel`; one segment: from 0, and
    the count stored here)."""
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    j = tl.program_id(1)
    lo = j * SEG
    n_row = count_ptr + pid * SPLITS
    c_row = cand_ptr + pid * s_cr
    if SPLITS_POW2 > 1:
        c_row += _counted(n_row, j, SPLITS_POW2)
    cnt = _compact_keys(x_row, c_row, lo, tl.minimum(lo + SEG, n), tl.load(floor_ptr + pid), BLOCK)
    if SPLITS_POW2 == 1:
        tl.store(n_row, cnt)


@triton.jit
def _refill_kernel(x_ptr, pos_ptr, count_ptr, cand_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt, s_cr, SPLITS,
                   BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """A row whose sample's floor was too high (fewer than kk candidates: rare) takes every visible key instead (its
    count moves to the first segment's). Its own kernel, so the finish kernel carries no whole-row compaction code
    (registers, shared memory)."""
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    n_row = count_ptr + pid * SPLITS
    if _counted(n_row, SPLITS, SPLITS_POW2) < kk:
        tl.store(n_row, _compact_keys(x_row, cand_ptr + pid * s_cr, 0, n, INT32_MIN, BLOCK))
        for j in range(1, SPLITS):
            tl.store(n_row + j, 0)


@triton.jit
def _finish_kernel(x_ptr, pos_ptr, count_ptr, cand_ptr, out_ptr, S, TOPK, ROWS_PER_B,
                   s_xb, s_xt, s_pb, s_pt, s_cr, s_ob, s_ot, SPLITS, BLOCK: tl.constexpr, SPLITS_POW2: tl.constexpr):
    """The kk best candidates of the row -> their indices, ascending (-inf ones dropped), then -1 up to TOPK."""
    pid, b, t, x_row, n, kk = _row_setup(x_ptr, pos_ptr, S, TOPK, ROWS_PER_B, s_xb, s_xt, s_pb, s_pt)
    c_row = cand_ptr + pid * s_cr
    o_row = out_ptr + b * s_ob + t * s_ot
    n_c = _counted(count_ptr + pid * SPLITS, SPLITS, SPLITS_POW2)
    thr = _key_threshold(c_row, n_c, kk, BLOCK)
    offs = tl.arange(0, BLOCK)
    n_out = n_c * 0
    for c0 in range(0, n_c, BLOCK):
        ci = c0 + offs
        key = tl.load(c_row + ci, mask=ci < n_c, other=INT64_MIN)
        take = (ci < n_c) & (key >= thr) & ((key >> 32) > NEG_INF_ORDERED)
        idx = 2147483647 - key.to(tl.int32)  # the low word (truncation) is 2^31 - 1 - index
        tl.store(o_row + n_out + tl.cumsum(take.to(tl.int32), 0) - 1, idx, mask=take)
        n_out += tl.sum(take.to(tl.int32), 0)
    for p0 in range(n_out, TOPK, BLOCK):
        tl.store(o_row + p0 + offs, -1, mask=p0 + offs < TOPK)


# Up to this many rows (decode steps) a row's finish runs 8 warps over 1024-key blocks: with fewer programs than
# about two per SM, one row's latency sets the kernel's time (bench on an H200, 64 rows at 8K / 32K / 128K keys,
# top-2048: 15.2 / 23.7 / 38.4 us against 19.9 / 30.5 / 50.1 for the many-row default below).
FEW_ROWS = 256


def select_config(S: int, overrides: dict | None = None, rows: int | None = None) -> dict:
    """Shape-only defaults. BLOCK: the compaction's block; BLOCK_FINISH: the finish's; SAMPLE: the floor's sample;
    whole_row=True skips the floor (every visible key is a candidate: the path a missed sample takes, for tests and
    benchmarks); programs: the compaction's target program count (None: 4 per SM). Unknown keys are refused.
    A one-warp compaction (its prefix sum needs no barrier across warps) of 512-key blocks, SAMPLE 1024 and a
    4-warp finish of 512-key blocks were the fastest on an H200 at 8K-128K keys (docs/kernels.md); up to FEW_ROWS
    `rows` the finish takes 8 warps over 1024-key blocks."""
    p2 = max(16, triton.next_power_of_2(S))
    few = rows is not None and rows <= FEW_ROWS
    cfg = dict(BLOCK=min(512, p2), BLOCK_FINISH=min(1024 if few else 512, p2), SAMPLE=min(1024, p2),
               whole_row=False, warps_floor=4, warps_compact=1, warps_finish=8 if few else 4, programs=None)
    unknown = set(overrides or {}) - set(cfg)
    if unknown:
        raise ValueError(f"radix_topk_triton: unknown config keys {sorted(unknown)} (known: {sorted(cfg)})")
    cfg.update(overrides or {})
    return cfg


def _programs(device) -> int:
    """The compaction's default target program count: 4 per SM."""
    if torch.device(device).type != "cuda":
        return 16
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def select_scratch(rows: int, S: int, device, programs: int | None = None) -> dict:
    """Scratch for `radix_topk_triton` over up to `rows` rows, reusable across calls: int64 candidate keys
    [rows, S], int32 floors [rows] and segment counts, flat: a call of r <= rows rows cuts each into at most
    cdiv(programs, r) segments, so r x segments <= rows + programs (programs: the config's, default 4 per SM)."""
    programs = _programs(device) if programs is None else programs
    return dict(cand=torch.empty(rows, max(S, 1), device=device, dtype=torch.int64),
                floor=torch.empty(rows, device=device, dtype=torch.int32),
                count=torch.empty(rows + programs, device=device, dtype=torch.int32))


def _splits(rows: int, S: int, block: int, programs: int | None, device) -> int:
    """Segments per row for the compaction pass (shape-only): enough rows x segments to fill the GPU ~4 times."""
    programs = _programs(device) if programs is None else programs
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
    cfg = select_config(S, overrides, B * T)
    if out is None:
        out = torch.empty(B, T, topk, device=scores.device, dtype=torch.int32)
    rows = B * T
    sc = scratch if scratch is not None else select_scratch(rows, S, scores.device, cfg["programs"])
    splits = _splits(rows, S, cfg["BLOCK"], cfg["programs"], scores.device)
    if sc["cand"].shape[0] < rows or sc["cand"].shape[1] < S or sc["count"].numel() < rows * splits:
        raise ValueError(f"radix_topk_triton: scratch {tuple(sc['cand'].shape)} / {sc['count'].numel()} counts too "
                         f"small for {rows} rows x {S} keys in {splits} segments")
    if rows == 0:
        return out
    row_args = (S, topk, T, scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1))
    if cfg["whole_row"]:
        sc["floor"][:rows].fill_(-2**31)
    else:
        _floor_kernel[(rows,)](scores, positions, sc["floor"], *row_args, SAMPLE=cfg["SAMPLE"],
                               num_warps=cfg["warps_floor"])
    seg = triton.cdiv(triton.cdiv(S, splits), cfg["BLOCK"]) * cfg["BLOCK"]
    s_cr = sc["cand"].stride(0)
    split_args = dict(SPLITS_POW2=triton.next_power_of_2(splits))
    if splits > 1:
        _count_kernel[(rows, splits)](scores, positions, sc["floor"], sc["count"], *row_args, seg, splits,
                                      BLOCK=cfg["BLOCK"], num_warps=cfg["warps_compact"])
    _compact_kernel[(rows, splits)](scores, positions, sc["floor"], sc["count"], sc["cand"], *row_args, s_cr, seg,
                                    splits, BLOCK=cfg["BLOCK"], num_warps=cfg["warps_compact"], **split_args)
    _refill_kernel[(rows,)](scores, positions, sc["count"], sc["cand"], *row_args, s_cr, splits,
                            BLOCK=cfg["BLOCK"], num_warps=cfg["warps_compact"], **split_args)
    _finish_kernel[(rows,)](scores, positions, sc["count"], sc["cand"], out, *row_args, s_cr, out.stride(0),
                            out.stride(1), splits, BLOCK=cfg["BLOCK_FINISH"], num_warps=cfg["warps_finish"],
                            **split_args)
    return out
