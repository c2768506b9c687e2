"""The "scan" select for rows up to a few thousand keys (`triton_select.select_config`: algo "scan"): one kernel,
one program per row, a radix select over the whole visible row. Longer rows take the sampled select in
`triton_select`."""
from __future__ import annotations

import triton
import triton.language as tl

from .radix_bits import INT32_MAX, NEG_INF_ORDERED, SIGN, _ordered, _threshold_bucket


@triton.jit
def _scan_topk_kernel(
    x_ptr, pos_ptr, cand_ptr, out_ptr,
    S, TOPK, ROWS_PER_B,
    s_xb, s_xt, s_pb, s_pt, s_cr, s_ob, s_ot,
    BLOCK: tl.constexpr, K_POW2: tl.constexpr,
):
    """Rows up to ~64K keys: a histogram of the top byte over the whole visible row, a compaction pass (higher
    buckets -> out, the threshold bucket -> int32 candidate indices), byte-by-byte refinement over the candidates,
    the ties lowest index first, a sort of the kk survivors' indices."""
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
    # 5. the survivors (higher buckets, then the threshold bucket's) in ascending key order, -inf ones dropped, -1 after
    ks = tl.arange(0, K_POW2)
    live = ks < kk
    sidx = tl.load(o_row + ks, mask=live, other=0)
    o = _ordered(tl.load(x_row + sidx, mask=live, other=float("-inf")))
    sidx = tl.where(live & (o > NEG_INF_ORDERED), sidx, INT32_MAX)
    tl.debug_barrier()  # every survivor is loaded before slots are overwritten
    sidx = tl.sort(sidx)
    tl.store(o_row + ks, tl.where(sidx < INT32_MAX, sidx, -1), mask=ks < TOPK)
