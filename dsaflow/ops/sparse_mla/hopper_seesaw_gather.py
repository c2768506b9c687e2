"""The producer partition of the seesaw sparse MLA forward (`hopper_seesaw`): per work item it copies Q, then
gathers each pair's KV rows and block indices into the consumers' ring with cp.async. Gluon, triton 3.6."""
from __future__ import annotations

from .hopper_common import BLOCK_H, GLUON_ERROR

BLOCK_K = 64  # key rows per block: one S wgmma of N = 64 per warpgroup
HALF = 256  # output columns per consumer warpgroup (d_v 512 / 2)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from .hopper_common import issue_rows

    _BH = gl.constexpr(BLOCK_H)
    _BK = gl.constexpr(BLOCK_K)
    _HALF = gl.constexpr(HALF)

    @gluon.jit
    def _fill_lo(kl_st, idx_st, ready, empty, ph, kv_base, idx, blk_ptrs, blk_ok, S, s_kvs, offs_h, all_h):
        """One stage's value columns [0, 256) and its block's indices (blk_ptrs: the [64] slots, for the consumer's
        mask), once its last reader released them."""
        mbarrier.wait(empty, ph)
        async_copy.async_copy_global_to_shared(idx_st, blk_ptrs, mask=blk_ok)
        issue_rows(kl_st, kv_base, idx, S, s_kvs, 0, offs_h, all_h)
        async_copy.mbarrier_arrive(ready, increment_count=False)

    @gluon.jit
    def _fill_hi(kh_st, kr_st, ready, empty, ph, kv_base, idx, S, s_kvs, offs_h, all_h, offs_t, all_t):
        """One stage's value columns [256, 512) and rope tail, once their last reader released them."""
        mbarrier.wait(empty, ph)
        issue_rows(kh_st, kv_base, idx, S, s_kvs, _HALF, offs_h, all_h)
        issue_rows(kr_st, kv_base, idx, S, s_kvs, 2 * _HALF, offs_t, all_t)
        async_copy.mbarrier_arrive(ready, increment_count=False)

    @gluon.jit
    def _work_item(w, n_hblk, T, nk_ptr):
        """Work item w -> (b, t, first head, pairs). A query's head blocks are adjacent items, so the CTAs of one
        wave take them together and share its gathered rows in L2. Every item runs at least one pair: its last
        pair's stage-1 tiles are where the consumers stage O (a query with no valid key computes on masked slots)."""
        qi = (w // n_hblk).to(gl.int64)
        n_k = gl.load(nk_ptr + qi)  # the key extent: all partitions read this one value as their trip count
        return qi // T, qi % T, (w % n_hblk) * _BH, gl.maximum(gl.cdiv(n_k, 2 * _BK), 1)

    @gluon.jit
    def _pair_producer(q_ptr, kv_ptr, idx_ptr, nk_ptr, ql, qh, qr, kl, kh, kr, idx_smem, q_ready, q_free,
                       ready_lo, ready_hi, empty_lo, empty_hi, T, S, K, n_hblk, n_work, s_qb, s_qt, s_qh, s_kvb,
                       s_kvs, s_ib, s_it, D_T: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
        """Per work item: copy Q once the previous item's last S is done, then gather each pair's rows into stage
        0 (even block) and stage 1 (odd block), half by half in the order the consumers release them: stage 0 lo
        (with the block's indices), stage 1 hi + rope, stage 0 hi + rope, stage 1 lo + indices."""
        # 4 rows x 64 columns per warp instruction: a thread holds 4 of a block's row indices, not 16
        row_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        offs_h = gl.arange(0, _HALF, layout=gl.SliceLayout(0, row_l))
        offs_t = gl.arange(0, D_T, layout=gl.SliceLayout(0, row_l))
        all_h = offs_h < _HALF
        all_t = offs_t < D_T
        s_qb = gl.multiple_of(s_qb, 8)  # shape_reason checks: every row starts on 16 bytes
        s_qt = gl.multiple_of(s_qt, 8)
        s_qh = gl.multiple_of(s_qh, 8)
        s_kvs = gl.multiple_of(s_kvs, 8)
        offs_n = gl.arange(0, _BK, layout=gl.SliceLayout(1, row_l))  # a block's slots; Q's head rows (_BK == _BH)
        blk_l: gl.constexpr = gl.BlockedLayout([4], [32], [PRODUCER_WARPS], [0])  # a block's slots, 16 bytes a copy
        offs_c = gl.arange(0, _BK, layout=blk_l)
        g = 0  # pairs of earlier items: the ring's phases run on across items
        it = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            b, t, h0, n_pairs = _work_item(w, n_hblk, T, nk_ptr)
            kv_base = kv_ptr + b * gl.multiple_of(s_kvb, 8)
            idx_base = idx_ptr + b * s_ib + t * s_it
            ia = gl.load(idx_base + offs_n, mask=offs_n < K, other=-1)
            ib = gl.load(idx_base + _BK + offs_n, mask=_BK + offs_n < K, other=-1)
            q_base = q_ptr + b * s_qb + t * s_qt + h0.to(gl.int64) * s_qh
            mbarrier.wait(q_free, (it & 1) ^ 1)  # both consumers' last S of the previous item is done
            issue_rows(ql.index(0), q_base, offs_n, _BH, s_qh, 0, offs_h, all_h)
            issue_rows(qh.index(0), q_base, offs_n, _BH, s_qh, _HALF, offs_h, all_h)
            issue_rows(qr.index(0), q_base, offs_n, _BH, s_qh, 2 * _HALF, offs_t, all_t)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)
            for j in range(n_pairs):
                ph = ((g + j) & 1) ^ 1  # a fresh empty barrier passes parity 1 at once
                k2 = (2 * j + 2) * _BK  # the next pair's indices, loaded before the waits
                na = gl.load(idx_base + k2 + offs_n, mask=k2 + offs_n < K, other=-1)
                nb = gl.load(idx_base + _BK + k2 + offs_n, mask=_BK + k2 + offs_n < K, other=-1)
                k0 = 2 * j * _BK
                _fill_lo(kl.index(0), idx_smem.index(0), ready_lo.index(0), empty_lo.index(0), ph, kv_base, ia,
                         idx_base + k0 + offs_c, k0 + offs_c < K, S, s_kvs, offs_h, all_h)
                if j == 0:  # stage 0's hi half first: the previous item's epilogue still holds stage 1's hi tile
                    _fill_hi(kh.index(0), kr.index(0), ready_hi.index(0), empty_hi.index(0), ph, kv_base, ia, S,
                             s_kvs, offs_h, all_h, offs_t, all_t)
                    _fill_hi(kh.index(1), kr.index(1), ready_hi.index(1), empty_hi.index(1), ph, kv_base, ib, S,
                             s_kvs, offs_h, all_h, offs_t, all_t)
                else:  # stage 1's hi half is released first
                    _fill_hi(kh.index(1), kr.index(1), ready_hi.index(1), empty_hi.index(1), ph, kv_base, ib, S,
                             s_kvs, offs_h, all_h, offs_t, all_t)
                    _fill_hi(kh.index(0), kr.index(0), ready_hi.index(0), empty_hi.index(0), ph, kv_base, ia, S,
                             s_kvs, offs_h, all_h, offs_t, all_t)
                _fill_lo(kl.index(1), idx_smem.index(1), ready_lo.index(1), empty_lo.index(1), ph, kv_base, ib,
                         idx_base + _BK + k0 + offs_c, _BK + k0 + offs_c < K, S, s_kvs, offs_h, all_h)
                ia = na
                ib = nb
            g += n_pairs
            it += 1
