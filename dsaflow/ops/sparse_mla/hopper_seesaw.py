"""Warp-specialised sparse MLA forward for Hopper (sm_90), written in Gluon (triton 3.6): the "seesaw" schedule.

The contract is `sparse_mla_fwd_hopper`'s (below); `hopper_fwd_supports` is the capability rule (DeepSeek MLA shapes,
bf16/fp16, H a multiple of 64, sm_90, triton 3.6's Gluon). Roles: a producer partition (`hopper_seesaw_gather`)
gathers each query's selected latent rows with cp.async into a shared-memory ring; two consumer warpgroups compute
S = Q.K^T and O += P.V with wgmma and the online softmax in base 2.

Why not lock step: when both consumer warpgroups split every key block, each computes S with N = 32 (the Q
operand is read from shared memory twice per block), every block's row max needs a cross-warpgroup reduction, and
the tensor cores idle while both run the softmax. Here the two warpgroups take alternate 64-row key blocks of a pair
(A the even block in stage 0, B the odd one in stage 1), each computes its block's full S (N = 64), and each owns
half of the output columns (A [0, 256), B [256, 512)):

  A: m0 = max(m, rowmax S_a);  P_a = exp(S_a - m0);  O_lo = O_lo e^(m - m0) + P_a V_a,lo  (P_a from registers)
  B: m1 = max(m0, rowmax S_b); P_b = exp(S_b - m1);  O_hi = O_hi e^(m - m1) + P_b V_b,hi  (P_b from registers)
  A: O_lo = O_lo e^(m0 - m1) + P_b V_b,lo            B: O_hi += (P_a e^(m0 - m1)) V_a,hi

so one warpgroup's exponentials run beside the other's MMAs. The ring holds one pair (2 stages of [64, 576]), and
shared memory fits because of two things: each stage is released in halves (value columns [0, 256) and [256, 512) +
rope tail, each with its own ready / empty mbarrier), so the producer refills a half as soon as its last reader is
done; and A hands B its scaled P_a in stage 0's rope tile, which nobody reads after A's S. Shared memory: Q 72 KB +
ring 144 KB + P_b 8 KB + the ring's block indices 0.5 KB = 225 KB. Row sums are kept per warpgroup (relative to the
running max) and added at the end. Exchange mbarriers (one arrival each): m0 (A -> B), m1 (B -> A), pa (A -> B: P_a
written), pb (B -> A: P_b written), pb_free (A's MMA on P_b done), done_a / done_b (row sums written).

Persistent: one program per SM walks the work items (query, 64-head block) p, p + P, ...; the ring's and exchanges'
phases run on across items, so the producer gathers the next item's first pair while the consumers finish the last
one. Q is reloaded once both consumers' last S of an item is done (Q free -> Q ready), and each consumer stages its
O for the store in the stage-1 tile it read last, which it releases after (so the epilogue never waits on Q).
Every partition runs the pairs below the query's key extent (`triton_prefill.key_extent`), at least one; invalid
indices are not read (cp.async zero-fills) and score -inf; a query with no valid key writes out = 0 and lse = -inf.
Grids and buffers depend on shapes only (CUDA-graph safe). Measurements: docs/kernels.md.
"""
from __future__ import annotations

import torch

from .hopper_common import BLOCK_H, GLUON_ERROR, LOG2E, device_reason, gluon_reason, kernel_config, shape_reason
from .hopper_seesaw_gather import BLOCK_K, HALF
from .triton_decode import _num_sms
from .triton_prefill import key_extent

# PROGRAMS: how many persistent programs (0: one per SM; tests set a few, so each walks many items)
SEESAW_CFG = dict(PRODUCER_WARPS=4, PRODUCER_REGS=56, CONSUMER_REGS=224, PROGRAMS=0)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .hopper_common import signal
    from .hopper_seesaw_gather import _pair_producer, _work_item

    _BH = gl.constexpr(BLOCK_H)
    _BK = gl.constexpr(BLOCK_K)
    _HALF = gl.constexpr(HALF)
    # one consumer warpgroup's register layouts: S [64, 64] and its half of O [64, 256] (wgmma accumulators), and P as
    # the A operand of its P.V
    _S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    _O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    _A_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_L.value, k_width=2))

    @gluon.jit
    def _s_lo(ql, kl_st, ready, phase, sc, use_acc: gl.constexpr):
        """Wait for a stage's value columns [0, 256), issue S (+)= Q_lo K_lo^T (one async group)."""
        mbarrier.wait(ready, phase)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy
        return warpgroup_mma(ql, kl_st.permute((1, 0)), sc, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _s_hi(qh, qr, kh_st, kr_st, ready, phase, sc, use_acc: gl.constexpr):
        """Wait for a stage's columns [256, 512) and rope tail, issue S (+)= Q_hi K_hi^T + Q_r K_r^T (two groups)."""
        mbarrier.wait(ready, phase)
        fence_async_shared()
        sc = warpgroup_mma(qh, kh_st.permute((1, 0)), sc, use_acc=use_acc, is_async=True)
        return warpgroup_mma(qr, kr_st.permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _masked(sc, blk, idx_st, S, K, scale_log2):
        """S of block `blk` scaled to base 2, -inf where the slot holds no valid key. The block's indices come from
        shared memory, copied by the producer with its rows: loading them from global memory here would put an L2
        round trip on every block's critical path."""
        offs_k = blk * _BK + gl.arange(0, _BK, layout=gl.SliceLayout(0, _S_L))
        idx = idx_st.load(gl.SliceLayout(0, _S_L))
        return gl.where(((offs_k < K) & (idx >= 0) & (idx < S))[None, :], sc * scale_log2, float("-inf"))

    @gluon.jit
    def _stage_base(j):
        """0 as the index of a consumer's shared-memory tiles in pair j, written j >> 30: 0 for every real trip
        count but not provably, so the compiler cannot hoist the ~80 loop-invariant wgmma descriptors out of the
        loop (it kept them in registers and spilled them)."""
        return j >> 30

    @gluon.jit
    def _finite(m):
        """A running max that is still -inf (no valid key yet) as 0, so exp2(x - m) stays finite."""
        return gl.where(m == float("-inf"), 0.0, m)

    @gluon.jit
    def _rescale(acc, factor):
        return acc * gl.convert_layout(factor, gl.SliceLayout(1, _O_L))[:, None]

    @gluon.jit
    def _finish(acc, m_i, l_i, l_mine, l_theirs, done_mine, done_theirs, phase, o_smem, out_ptr, lse_ptr, b, t, h0,
                col0, s_ob, s_ot, s_oh, s_lb, s_lt, WRITE_LSE: gl.constexpr):
        """Add the other warpgroup's row sums, normalise this half of O, store it (and lse, from warpgroup A).
        o_smem: a [64, 256] ring tile this warpgroup still holds (it releases it after)."""
        l_mine.store(l_i)
        signal(done_mine)
        mbarrier.wait(done_theirs, phase)
        l_tot = l_i + l_theirs.load(gl.SliceLayout(1, _S_L))
        l_o = gl.convert_layout(l_tot, gl.SliceLayout(1, _O_L))
        # stage O through shared memory and store coalesced 16-byte rows (a store from the MMA layout would need
        # 128 64-bit pointers per thread)
        o_smem.store((acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]).to(o_smem.dtype))
        gl.thread_barrier()
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        rows = gl.arange(0, _BH, layout=gl.SliceLayout(1, st_l))
        cols = gl.arange(0, _HALF, layout=gl.SliceLayout(0, st_l))
        o_ptrs = out_ptr + b * s_ob + t * s_ot + (h0 + rows).to(gl.int64)[:, None] * s_oh + col0 + cols[None, :]
        gl.store(o_ptrs, o_smem.load(st_l))
        if WRITE_LSE:
            lse = gl.where(l_tot == 0.0, float("-inf"),
                           (m_i + gl.log2(gl.where(l_tot == 0.0, 1.0, l_tot))) * 0.6931471805599453)
            lrows = gl.arange(0, _BH, layout=gl.SliceLayout(1, _S_L))
            gl.store(lse_ptr + b * s_lb + t * s_lt + h0 + lrows, lse)

    @gluon.jit
    def _fresh_state():
        """A consumer's running row max and row sums, its half of O, and an S tile (every S is issued with
        use_acc=False on a dead tile)."""
        m_i = gl.full([_BH], float("-inf"), gl.float32, gl.SliceLayout(1, _S_L))
        l_i = gl.zeros([_BH], gl.float32, gl.SliceLayout(1, _S_L))
        acc = gl.zeros([_BH, _HALF], gl.float32, _O_L)
        sc = gl.zeros([_BH, _BK], gl.float32, _S_L)
        return m_i, l_i, acc, sc

    @gluon.jit
    def _consumer_a(ql, qh, qr, kl, kh, kr, idx_smem, pb_smem, m0_smem, m1_smem, la_smem, lb_smem, ready_lo, ready_hi,
                    empty_lo, xbar, q_ready, q_free, nk_ptr, out_ptr, lse_ptr, T, S, K, n_hblk, n_work,
                    s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2):
        """Even blocks' softmax; output columns [0, 256). xbar: m0, m1, pa, pb, pb_free, done_a, done_b."""
        dtype: gl.constexpr = ql.dtype
        g = 0  # pairs of earlier items (phases)
        it = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            b, t, h0, n_pairs = _work_item(w, n_hblk, T, nk_ptr)
            m_i, l_i, acc, sc = _fresh_state()
            mbarrier.wait(q_ready, it & 1)
            for j in range(n_pairs):
                ph = (g + j) & 1
                z = _stage_base(j)
                q_l, q_h, q_r = ql.index(z), qh.index(z), qr.index(z)
                k0_l, k0_h, k0_r = kl.index(z), kh.index(z), kr.index(z)  # stage 0: this warpgroup's block
                k1_l = kl.index(z + 1)  # stage 1's value columns [0, 256): B's block, for P_b V_b,lo
                if j == 0:
                    tok = _s_lo(q_l, k0_l, ready_lo.index(0), ph, sc, False)
                    tok = _s_hi(q_h, q_r, k0_h, k0_r, ready_hi.index(0), ph, tok, True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                if j + 1 == n_pairs:
                    signal(q_free)  # this item's last S is done: the producer may copy the next item's Q
                sc = _masked(sc, 2 * j, idx_smem.index(0), S, K, scale_log2)
                m0 = gl.maximum(m_i, gl.max(sc, 1))
                m0_smem.store(m0)
                signal(xbar.index(0))
                alpha = gl.exp2(m_i - _finite(m0))
                p = gl.exp2(sc - _finite(m0)[:, None]).to(dtype)  # bf16 only: it stays live until m1 arrives
                l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)
                tok = warpgroup_mma(gl.convert_layout(p, _A_L), k0_l, _rescale(acc, alpha), is_async=True)
                mbarrier.wait(xbar.index(1), ph)
                m1 = m1_smem.load(gl.SliceLayout(1, _S_L))
                beta = gl.exp2(m0 - _finite(m1))
                k0_r.store((p.to(gl.float32) * beta[:, None]).to(dtype))  # P_a for B, in the rope tile only A's S read
                fence_async_shared()
                signal(xbar.index(2))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                signal(empty_lo.index(0))
                acc = _rescale(acc, beta)
                l_i = l_i * beta
                mbarrier.wait(xbar.index(3), ph)  # P_b written
                mbarrier.wait(ready_lo.index(1), ph)  # stage 1's lo columns landed (B saw it; these threads too)
                fence_async_shared()
                tok = warpgroup_mma(pb_smem.index(z), k1_l, acc, is_async=True)
                if j + 1 < n_pairs:  # the next even block's S, its lo half issued behind P_b V_b,lo
                    stok = _s_lo(q_l, k0_l, ready_lo.index(0), ph ^ 1, sc, False)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(tok, ))
                    signal(empty_lo.index(1))
                    mbarrier.arrive(xbar.index(4), count=1)
                    stok = _s_hi(q_h, q_r, k0_h, k0_r, ready_hi.index(0), ph ^ 1, stok, True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(stok, ))
                else:  # the last pair: stage 1's lo tile stays held for the epilogue
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                    mbarrier.arrive(xbar.index(4), count=1)
                m_i = m1
            g += n_pairs
            _finish(acc, m_i, l_i, la_smem, lb_smem, xbar.index(5), xbar.index(6), it & 1, kl.index(1), out_ptr,
                    lse_ptr, b, t, h0, 0, s_ob, s_ot, s_oh, s_lb, s_lt, True)
            signal(empty_lo.index(1))
            it += 1

    @gluon.jit
    def _consumer_b(ql, qh, qr, kl, kh, kr, idx_smem, pb_smem, m0_smem, m1_smem, la_smem, lb_smem, ready_lo, ready_hi,
                    empty_hi, xbar, q_ready, q_free, nk_ptr, out_ptr, lse_ptr, T, S, K, n_hblk, n_work,
                    s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2):
        """Odd blocks' softmax; output columns [256, 512)."""
        dtype: gl.constexpr = ql.dtype
        g = 0
        it = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            b, t, h0, n_pairs = _work_item(w, n_hblk, T, nk_ptr)
            m_i, l_i, acc, sc = _fresh_state()
            mbarrier.wait(q_ready, it & 1)
            for j in range(n_pairs):
                ph = (g + j) & 1
                z = _stage_base(j)
                q_l, q_h, q_r = ql.index(z), qh.index(z), qr.index(z)
                k1_l, k1_h, k1_r = kl.index(z + 1), kh.index(z + 1), kr.index(z + 1)  # stage 1: this warpgroup's
                k0_h, p_a = kh.index(z), kr.index(z)  # stage 0: A's value columns [256, 512), P_a in its rope tile
                if j == 0:
                    tok = _s_hi(q_h, q_r, k1_h, k1_r, ready_hi.index(1), ph, sc, False)
                    tok = _s_lo(q_l, k1_l, ready_lo.index(1), ph, tok, True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
                if j + 1 == n_pairs:
                    signal(q_free)
                sc = _masked(sc, 2 * j + 1, idx_smem.index(1), S, K, scale_log2)
                mbarrier.wait(xbar.index(0), ph)
                m1 = gl.maximum(m0_smem.load(gl.SliceLayout(1, _S_L)), gl.max(sc, 1))
                m1_smem.store(m1)
                signal(xbar.index(1))
                alpha = gl.exp2(m_i - _finite(m1))
                p = gl.exp2(sc - _finite(m1)[:, None]).to(dtype)
                l_i = l_i * alpha + gl.sum(p.to(gl.float32), 1)
                tok = warpgroup_mma(gl.convert_layout(p, _A_L), k1_h, _rescale(acc, alpha), is_async=True)
                mbarrier.wait(xbar.index(4), ph ^ 1)  # A's MMA on the previous P_b is done
                pb_smem.index(z).store(p)
                fence_async_shared()
                signal(xbar.index(3))
                mbarrier.wait(xbar.index(2), ph)  # P_a written (in stage 0's rope tile)
                mbarrier.wait(ready_hi.index(0), ph)  # stage 0's hi columns landed (A saw it; these threads too)
                fence_async_shared()
                tok2 = warpgroup_mma(p_a, k0_h, tok, is_async=True)
                warpgroup_mma_wait(num_outstanding=1, deps=(m1, ))  # not tok: its registers are tok2's, in flight
                if j + 1 < n_pairs:  # the last pair's stage 1 hi tile stays held for the epilogue
                    signal(empty_hi.index(1))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(tok2, ))
                signal(empty_hi.index(0))
                if j + 1 < n_pairs:
                    stok = _s_hi(q_h, q_r, k1_h, k1_r, ready_hi.index(1), ph ^ 1, sc, False)
                    stok = _s_lo(q_l, k1_l, ready_lo.index(1), ph ^ 1, stok, True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(stok, ))
                m_i = m1
            g += n_pairs
            _finish(acc, m_i, l_i, lb_smem, la_smem, xbar.index(6), xbar.index(5), it & 1, kh.index(1), out_ptr,
                    lse_ptr, b, t, h0, _HALF, s_ob, s_ot, s_oh, s_lb, s_lt, False)
            signal(empty_hi.index(1))
            it += 1

    @gluon.jit
    def _seesaw_fwd_kernel(
        q_ptr, kv_ptr, idx_ptr, nk_ptr, out_ptr, lse_ptr,
        T, S, K, n_hblk, n_work, scale_log2,
        s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt,
        D_T: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        """Persistent: program p takes work items p, p + P, ... (P programs, one per SM at most)."""
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        half_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _HALF], dtype)
        tail_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, D_T], dtype)
        row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        ql = gl.allocate_shared_memory(dtype, [1, _BH, _HALF], half_sl)
        qh = gl.allocate_shared_memory(dtype, [1, _BH, _HALF], half_sl)
        qr = gl.allocate_shared_memory(dtype, [1, _BH, D_T], tail_sl)
        kl = gl.allocate_shared_memory(dtype, [2, _BK, _HALF], half_sl)
        kh = gl.allocate_shared_memory(dtype, [2, _BK, _HALF], half_sl)
        kr = gl.allocate_shared_memory(dtype, [2, _BK, D_T], tail_sl)  # [64, 64]: also P_a's tile ([heads, keys])
        pb_smem = gl.allocate_shared_memory(dtype, [1, _BH, _BK], tail_sl)
        idx_smem = gl.allocate_shared_memory(gl.int32, [2, _BK], row_sl)
        m0_smem = gl.allocate_shared_memory(gl.float32, [_BH], row_sl)
        m1_smem = gl.allocate_shared_memory(gl.float32, [_BH], row_sl)
        la_smem = gl.allocate_shared_memory(gl.float32, [_BH], row_sl)
        lb_smem = gl.allocate_shared_memory(gl.float32, [_BH], row_sl)
        ready_lo = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready_hi = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_lo = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_hi = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        xbar = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
        qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # Q ready, Q free
        for i in gl.static_range(2):
            mbarrier.init(ready_lo.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(ready_hi.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty_lo.index(i), count=1)
            mbarrier.init(empty_hi.index(i), count=1)
        for i in gl.static_range(7):
            mbarrier.init(xbar.index(i), count=1)
        mbarrier.init(qbar.index(0), count=PRODUCER_WARPS * 32)
        mbarrier.init(qbar.index(1), count=2)  # both consumers' last S of an item
        fence_async_shared()
        gl.thread_barrier()

        # (argument tuples written out: a tuple bound to a name first turns its constexprs into tensors)
        gl.warp_specialize(
            [
                (_consumer_a, (ql, qh, qr, kl, kh, kr, idx_smem, pb_smem, m0_smem, m1_smem, la_smem, lb_smem, ready_lo,
                               ready_hi, empty_lo, xbar, qbar.index(0), qbar.index(1), nk_ptr, out_ptr,
                               lse_ptr, T, S, K, n_hblk, n_work, s_ob, s_ot, s_oh, s_lb, s_lt,
                               scale_log2)),
                (_consumer_b, (ql, qh, qr, kl, kh, kr, idx_smem, pb_smem, m0_smem, m1_smem, la_smem, lb_smem, ready_lo,
                               ready_hi, empty_hi, xbar, qbar.index(0), qbar.index(1), nk_ptr, out_ptr,
                               lse_ptr, T, S, K, n_hblk, n_work, s_ob, s_ot, s_oh, s_lb, s_lt,
                               scale_log2)),
                (_pair_producer, (q_ptr, kv_ptr, idx_ptr, nk_ptr, ql, qh, qr, kl, kh, kr, idx_smem, qbar.index(0),
                                  qbar.index(1), ready_lo, ready_hi, empty_lo, empty_hi, T, S, K, n_hblk, n_work,
                                  s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, D_T, PRODUCER_WARPS)),
            ],
            [4, PRODUCER_WARPS],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


def hopper_fwd_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if `sparse_mla_fwd_hopper` takes these inputs, else the reason it does not (no GPU needed to ask)."""
    return device_reason(q) or shape_reason(q, kv, indices, d_v) or gluon_reason()


def launch_hopper_fwd(q, kv, indices, sm_scale, d_v, out, lse, cfg: dict | None = None, n_keys=None):
    """Fill out [B, T, H, 512] and lse [B, T, H] fp32 (both with unit last stride) for inputs that
    `hopper_fwd_supports` accepts; n_keys [B, T] int32 contiguous = `key_extent(indices, S)` (computed when not
    given). cfg: knobs of `SEESAW_CFG`. Returns the compiled kernel handle (registers, spills)."""
    assert out.stride(-1) == 1 and lse.stride(-1) == 1, "out and lse need unit last strides"
    c = kernel_config(SEESAW_CFG, cfg, "sparse MLA seesaw forward")
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    if n_keys is None:
        n_keys = key_extent(indices, S)
    n_hblk = H // BLOCK_H
    n_work = n_hblk * B * T
    programs = min(n_work, c["PROGRAMS"] or _num_sms(q.device.index))
    return _seesaw_fwd_kernel[(programs,)](
        q, kv, indices, n_keys, out, lse,
        T, S, K, n_hblk, n_work, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        D_T=D_qk - 2 * HALF, PRODUCER_WARPS=c["PRODUCER_WARPS"], PRODUCER_REGS=c["PRODUCER_REGS"],
        CONSUMER_REGS=c["CONSUMER_REGS"], num_warps=4,
    )


def sparse_mla_fwd_hopper(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, cfg: dict | None = None,
    n_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill forward on sm_90: q [B, T, H, 576], kv [B, S, 576], indices [B, T, K] int32 (-1 / >= S: no key)
    -> out [B, T, H, 512] q.dtype, lse [B, T, H] fp32 (natural log; -inf and out 0 for a query with no valid key).
    Raises ValueError with the reason when `hopper_fwd_supports` refuses the inputs (no silent fallback)."""
    reason = hopper_fwd_supports(q, kv, indices, d_v)
    if reason is not None:
        raise ValueError(f"sparse_mla_fwd_hopper: {reason}")
    B, T, H, _ = q.shape
    out = torch.empty(B, T, H, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    launch_hopper_fwd(q, kv, indices, sm_scale, d_v, out, lse, cfg, n_keys)
    return out, lse
