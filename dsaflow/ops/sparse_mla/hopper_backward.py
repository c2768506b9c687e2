"""Warp-specialised pass 1 of the sparse MLA backward for Hopper (sm_90), in Gluon (triton 3.6).

It computes what `triton_backward._sparse_mla_bwd_ds_kernel` computes, to the same G [chunk, 2H, K] (rows 0..H-1
dS, H..2H-1 P) and, for the indexer-loss target, the same head sums of P per slot; the dq and dkv kernels that read G
are triton_backward's. `hopper_bwd_supports` is the capability rule (the forward's: DeepSeek MLA shapes, bf16/fp16,
H a multiple of 64, sm_90, triton 3.6's Gluon); `dispatch.py` picks it (the `hopper` backward).

Why: the Triton pass 1 runs at about 200 TFLOP/s on an H200: its key rows are gathered by plain loads in the warps
that run the MMAs, with no room in shared memory to pipeline them beside resident Q and dO. Here a producer partition
gathers with cp.async into a ring while two consumer warpgroups compute, as in the forward (`hopper_seesaw`).

Roles, per work item (query, 64-head block):
  producer   once both consumers' last MMA of the previous item is done (q_free), copies Q [64, 576] into shared
             memory (q_ready); then gathers each key block's rows [32, 576] and its 32 indices into the next slot of
             a 4-slot ring once that slot is free. Slots and phases count the program's blocks across items.
  consumer c (warpgroup c = 0, 1) takes blocks c, c + 2, ...: S = Q.K^T (Q from shared memory) and dP = dO.K_v^T
             (dO held in registers as the A operand, loaded once per item) as five wgmma of N = 32; then
             P = exp2(S log2e scale - lse log2e) (0 at invalid slots), dS = P (dP - delta) scale with
             delta = rowsum(dO * O) - dlse (fp32, from global memory at the item's start); dS and P are staged in
             the slot the MMAs just read and stored to G as 16-byte runs (4-byte stores from the MMA layout cost a
             fifth of the kernel's time), and the slot is released.
The blocks are independent given lse and delta (no running max), so the consumers never wait on each other.
Shared memory: Q 72 KB + ring 4 x 36 KB + indices = 217 KB; each consumer has two blocks in flight.
Every partition runs the blocks below the query's key extent (`triton_prefill.key_extent`), rounded up to BLOCK_K:
G is written up to there, as the dq and dkv kernels expect (their DS_BLOCK_K = BLOCK_K). Invalid indices are not
read (cp.async zero-fills). Persistent: one program per SM walks the items; grids and buffers depend on shapes only.
Measurements: docs/kernels.md.
"""
from __future__ import annotations

import torch

from .hopper_common import BLOCK_H, GLUON_ERROR, LOG2E, device_reason, gluon_reason, kernel_config, shape_reason
from .triton_decode import _num_sms

BLOCK_K = 32  # key rows per block
STAGES = 4  # ring slots: two blocks in flight per consumer, beside the resident Q
HALF = 256  # the value columns are copied and multiplied in two halves (one NVMMA tile width each)

# PROGRAMS: how many persistent programs (0: one per SM; tests set a few, so each walks many items)
DS_CFG = dict(PRODUCER_WARPS=4, PRODUCER_REGS=40, CONSUMER_REGS=232, PROGRAMS=0)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .hopper_common import issue_rows, signal

    _BH = gl.constexpr(BLOCK_H)
    _BK = gl.constexpr(BLOCK_K)
    _HALF = gl.constexpr(HALF)
    _STAT_COLS = gl.constexpr(64)  # columns of dO and O per load when summing delta
    # S and dP [64, 32] (wgmma accumulators of one consumer warpgroup)
    _S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16]))
    _A_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_S_L.value, k_width=2))  # dO as dP's A operand
    _STAGES = gl.constexpr(STAGES)
    # dS / P [64, 32] on their way to G: staged in shared memory, then 8 contiguous columns per thread
    _G_L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
    _G_SL = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [1, 0]))

    @gluon.jit
    def _ds_item(w, n_hblk, q0, T, nk_ptr):
        """Work item w -> (query qi, b, t, first head, key blocks). A query's head blocks are adjacent items, so the
        programs of one wave take them together and share its gathered rows in L2."""
        qi = q0 + (w // n_hblk).to(gl.int64)
        n_k = gl.load(nk_ptr + qi)  # the key extent: every partition reads this one value as its trip count
        return qi, qi // T, qi % T, (w % n_hblk) * _BH, gl.cdiv(n_k, _BK)

    @gluon.jit
    def _row_stats(o_ptr, do_ptr, lse_ptr, dlse_ptr, b, t, h0, s_ob, s_ot, s_oh, s_dob, s_dot, s_doh, s_lb, s_lt,
                   s_dlb, s_dlt, D_V: gl.constexpr, HAS_DLSE: gl.constexpr):
        """lse in base 2 (0 where -inf: such a query has no valid slot, so every P is masked) and
        delta = rowsum(dO * O) - dlse in fp32, for the item's 64 heads, in the rows layout of S."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, _BH, layout=gl.SliceLayout(1, ld_l))
        cols = gl.arange(0, _STAT_COLS, layout=gl.SliceLayout(0, ld_l))
        o_rows = o_ptr + b * s_ob + t * s_ot + (h0 + rows).to(gl.int64)[:, None] * s_oh + cols[None, :]
        do_rows = do_ptr + b * s_dob + t * s_dot + (h0 + rows).to(gl.int64)[:, None] * s_doh + cols[None, :]
        acc = gl.zeros([_BH, _STAT_COLS], gl.float32, ld_l)
        for c0 in range(0, D_V, _STAT_COLS):
            acc += gl.load(o_rows + c0).to(gl.float32) * gl.load(do_rows + c0).to(gl.float32)
        delta = gl.convert_layout(gl.sum(acc, 1), gl.SliceLayout(1, _S_L))
        heads = h0 + gl.arange(0, _BH, layout=gl.SliceLayout(1, _S_L))
        if HAS_DLSE:
            delta -= gl.load(dlse_ptr + b * s_dlb + t * s_dlt + heads).to(gl.float32)
        lse = gl.load(lse_ptr + b * s_lb + t * s_lt + heads)
        return gl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634), delta

    @gluon.jit
    def _load_do(do_ptr, b, t, h0, s_dob, s_dot, s_doh, col0):
        """dO[:, col0 : col0 + 256] of the item's 64 heads, straight into the registers of dP's A operand."""
        rows = gl.arange(0, _BH, layout=gl.SliceLayout(1, _A_L))
        cols = gl.arange(0, _HALF, layout=gl.SliceLayout(0, _A_L))
        base = do_ptr + b * s_dob + t * s_dot + col0
        return gl.load(base + (h0 + rows).to(gl.int64)[:, None] * s_doh + cols[None, :])

    @gluon.jit
    def _ds_consumer(c, ql, qh, qr, kl, kh, kr, idx_smem, q_ready, q_free, ready, empty,
                     nk_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, g_ptr, ps_ptr, q0, T, S, K, H, n_hblk, n_work,
                     s_ob, s_ot, s_oh, s_dob, s_dot, s_doh, s_lb, s_lt, s_dlb, s_dlt, s_gq, s_gh, s_psh, s_psq,
                     sm_scale, scale_log2, D_V: gl.constexpr, HAS_DLSE: gl.constexpr, SUM_P: gl.constexpr):
        """Consumer warpgroup c: blocks c, c + 2, ... of every item (ring slot: the program's block count mod 4)."""
        dtype: gl.constexpr = ql.dtype
        offs_k = gl.arange(0, _BK, layout=gl.SliceLayout(0, _S_L))
        g_rows = gl.arange(0, _BH, layout=gl.SliceLayout(1, _G_L))
        g_cols = gl.arange(0, _BK, layout=gl.SliceLayout(0, _G_L))
        s_acc = gl.zeros([_BH, _BK], gl.float32, _S_L)  # dead tiles: every MMA chain starts with use_acc=False
        dp_acc = gl.zeros([_BH, _BK], gl.float32, _S_L)
        base = 0  # blocks of this program's earlier items: block i of an item is ring block base + i
        it = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            qi, b, t, h0, n_blk = _ds_item(w, n_hblk, q0, T, nk_ptr)
            lse2, delta = _row_stats(o_ptr, do_ptr, lse_ptr, dlse_ptr, b, t, h0, s_ob, s_ot, s_oh, s_dob, s_dot,
                                     s_doh, s_lb, s_lt, s_dlb, s_dlt, D_V, HAS_DLSE)
            do_lo = _load_do(do_ptr, b, t, h0, s_dob, s_dot, s_doh, 0)
            do_hi = _load_do(do_ptr, b, t, h0, s_dob, s_dot, s_doh, _HALF)
            g_item = g_ptr + (qi - q0) * s_gq
            g_offs = (h0 + g_rows)[:, None] * s_gh + g_cols[None, :]  # one int32 tile serves both stores
            ps_row = ps_ptr + (h0 // _BH).to(gl.int64) * s_psh + (qi - q0) * s_psq
            mine = (n_blk + 1 - c) // 2
            mbarrier.wait(q_ready, it & 1)
            for j in range(mine):
                blk = c + 2 * j
                slot = (base + blk) % _STAGES
                mbarrier.wait(ready.index(slot), ((base + blk) // _STAGES) & 1)
                fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
                z = j >> 30  # 0, but not provably: the ~70 wgmma descriptors are not hoisted out of the loop (spills)
                k_l, k_h, k_r = kl.index(slot + z), kh.index(slot + z), kr.index(slot + z)
                s_acc = warpgroup_mma(ql.index(z), k_l.permute((1, 0)), s_acc, use_acc=False, is_async=True)
                s_acc = warpgroup_mma(qh.index(z), k_h.permute((1, 0)), s_acc, is_async=True)
                s_acc = warpgroup_mma(qr.index(z), k_r.permute((1, 0)), s_acc, is_async=True)
                dp_acc = warpgroup_mma(do_lo, k_l.permute((1, 0)), dp_acc, use_acc=False, is_async=True)
                dp_acc = warpgroup_mma(do_hi, k_h.permute((1, 0)), dp_acc, is_async=True)
                s_acc, dp_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc, dp_acc))
                if j + 1 == mine:
                    signal(q_free)  # this item's last read of Q is done
                idx = idx_smem.index(slot).load(gl.SliceLayout(0, _S_L))
                slots = blk * _BK + offs_k
                valid = (slots < K) & (idx >= 0) & (idx < S)
                p = gl.where(valid[None, :], gl.exp2(s_acc * scale_log2 - lse2[:, None]), 0.0)
                ds = p * (dp_acc - delta[:, None]) * sm_scale
                if SUM_P:
                    gl.store(ps_row + slots, gl.sum(p, 0), mask=slots < K)
                # dS and P go out through the slot the MMAs just read (its rows are dead): stored from the MMA
                # layout, each row of G is written as 64-byte runs of 16-byte stores instead of 4-byte ones
                staged = kl.index(slot)._reinterpret(dtype, [2, _BH, _BK], _G_SL)
                staged.index(0).store(ds.to(dtype))
                staged.index(1).store(p.to(dtype))
                gl.thread_barrier()
                ds_g = staged.index(0).load(_G_L)
                p_g = staged.index(1).load(_G_L)
                signal(empty.index(slot))
                ok = (blk * _BK + g_cols < K)[None, :] & (g_rows >= 0)[:, None]
                g_blk = g_item + blk * _BK
                gl.store(g_blk + g_offs, ds_g, mask=ok)
                gl.store(g_blk + H * s_gh + g_offs, p_g, mask=ok)
            if mine == 0:
                signal(q_free)  # no block: nothing of this item reads Q
            base += n_blk
            it += 1

    @gluon.jit
    def _ds_producer(q_ptr, kv_ptr, idx_ptr, nk_ptr, ql, qh, qr, kl, kh, kr, idx_smem, q_ready, q_free, ready, empty,
                     q0, T, S, K, n_hblk, n_work, s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, D_T: gl.constexpr,
                     PRODUCER_WARPS: gl.constexpr):
        """Per item: Q once the previous item's last MMA is done, then each block's rows and indices."""
        row_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        offs_h = gl.arange(0, _HALF, layout=gl.SliceLayout(0, row_l))
        offs_t = gl.arange(0, D_T, layout=gl.SliceLayout(0, row_l))
        all_h = offs_h < _HALF
        all_t = offs_t < D_T
        s_qh = gl.multiple_of(s_qh, 8)  # shape_reason checks: every row starts on 16 bytes
        s_kvs = gl.multiple_of(s_kvs, 8)
        heads = gl.arange(0, _BH, layout=gl.SliceLayout(1, row_l))
        offs_n = gl.arange(0, _BK, layout=gl.SliceLayout(1, row_l))
        blk_l: gl.constexpr = gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0])
        offs_c = gl.arange(0, _BK, layout=blk_l)
        base = 0  # blocks of earlier items: the ring's slots and phases run on across items
        it = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            qi, b, t, h0, n_blk = _ds_item(w, n_hblk, q0, T, nk_ptr)
            kv_base = kv_ptr + b * gl.multiple_of(s_kvb, 8)
            idx_base = idx_ptr + b * s_ib + t * s_it
            nxt = gl.load(idx_base + offs_n, mask=offs_n < K, other=-1)
            q_base = q_ptr + b * gl.multiple_of(s_qb, 8) + t * gl.multiple_of(s_qt, 8) + h0.to(gl.int64) * s_qh
            mbarrier.wait(q_free, (it & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            issue_rows(ql.index(0), q_base, heads, _BH, s_qh, 0, offs_h, all_h)
            issue_rows(qh.index(0), q_base, heads, _BH, s_qh, _HALF, offs_h, all_h)
            issue_rows(qr.index(0), q_base, heads, _BH, s_qh, 2 * _HALF, offs_t, all_t)
            async_copy.mbarrier_arrive(q_ready, increment_count=False)
            for blk in range(n_blk):
                idx = nxt
                k0 = blk * _BK
                nxt = gl.load(idx_base + k0 + _BK + offs_n, mask=k0 + _BK + offs_n < K, other=-1)
                slot = (base + blk) % _STAGES
                mbarrier.wait(empty.index(slot), (((base + blk) // _STAGES) & 1) ^ 1)
                async_copy.async_copy_global_to_shared(idx_smem.index(slot), idx_base + k0 + offs_c,
                                                       mask=k0 + offs_c < K)
                issue_rows(kl.index(slot), kv_base, idx, S, s_kvs, 0, offs_h, all_h)
                issue_rows(kh.index(slot), kv_base, idx, S, s_kvs, _HALF, offs_h, all_h)
                issue_rows(kr.index(slot), kv_base, idx, S, s_kvs, 2 * _HALF, offs_t, all_t)
                async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            base += n_blk
            it += 1

    @gluon.jit
    def _sparse_mla_bwd_ds_hopper_kernel(
        q_ptr, kv_ptr, idx_ptr, nk_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, g_ptr, ps_ptr,
        q0, T, S, K, H, n_hblk, n_work, sm_scale, scale_log2,
        s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_dob, s_dot, s_doh, s_ob, s_ot, s_oh, s_lb, s_lt, s_dlb, s_dlt,
        s_gq, s_gh, s_psh, s_psq,
        D_T: gl.constexpr, HAS_DLSE: gl.constexpr, SUM_P: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        """Persistent: program p takes work items p, p + P, ... (P programs, one per SM at most)."""
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, _HALF], dtype)
        qt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, D_T], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BK, _HALF], dtype)
        kt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BK, D_T], dtype)
        row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        ql = gl.allocate_shared_memory(dtype, [1, _BH, _HALF], q_sl)
        qh = gl.allocate_shared_memory(dtype, [1, _BH, _HALF], q_sl)
        qr = gl.allocate_shared_memory(dtype, [1, _BH, D_T], qt_sl)
        kl = gl.allocate_shared_memory(dtype, [_STAGES, _BK, _HALF], k_sl)
        kh = gl.allocate_shared_memory(dtype, [_STAGES, _BK, _HALF], k_sl)
        kr = gl.allocate_shared_memory(dtype, [_STAGES, _BK, D_T], kt_sl)
        idx_smem = gl.allocate_shared_memory(gl.int32, [_STAGES, _BK], row_sl)
        ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # Q ready, Q free
        for i in gl.static_range(_STAGES):
            mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(qbar.index(0), count=PRODUCER_WARPS * 32)
        mbarrier.init(qbar.index(1), count=2)  # both consumers' last MMA of an item
        fence_async_shared()
        gl.thread_barrier()

        # (argument tuples written out: a tuple bound to a name first turns its constexprs into tensors)
        gl.warp_specialize(
            [
                (_ds_consumer, (0, ql, qh, qr, kl, kh, kr, idx_smem, qbar.index(0), qbar.index(1), ready,
                                empty, nk_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, g_ptr, ps_ptr, q0, T, S, K, H,
                                n_hblk, n_work, s_ob, s_ot, s_oh, s_dob, s_dot, s_doh, s_lb, s_lt, s_dlb, s_dlt, s_gq,
                                s_gh, s_psh, s_psq, sm_scale, scale_log2, 2 * _HALF, HAS_DLSE, SUM_P)),
                (_ds_consumer, (1, ql, qh, qr, kl, kh, kr, idx_smem, qbar.index(0), qbar.index(1), ready,
                                empty, nk_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, g_ptr, ps_ptr, q0, T, S, K, H,
                                n_hblk, n_work, s_ob, s_ot, s_oh, s_dob, s_dot, s_doh, s_lb, s_lt, s_dlb, s_dlt, s_gq,
                                s_gh, s_psh, s_psq, sm_scale, scale_log2, 2 * _HALF, HAS_DLSE, SUM_P)),
                (_ds_producer, (q_ptr, kv_ptr, idx_ptr, nk_ptr, ql, qh, qr, kl, kh, kr, idx_smem, qbar.index(0),
                                qbar.index(1), ready, empty, q0, T, S, K, n_hblk, n_work, s_qb, s_qt, s_qh, s_kvb,
                                s_kvs, s_ib, s_it, D_T, PRODUCER_WARPS)),
            ],
            [4, PRODUCER_WARPS],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


def hopper_bwd_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if the Gluon pass 1 takes these inputs, else the reason it does not (no GPU needed to ask)."""
    return device_reason(q) or shape_reason(q, kv, indices, d_v) or gluon_reason()


def launch_hopper_ds(q, kv, indices, n_keys, d_out, out, lse, d_lse, g, p_sums, q0: int, n: int, sm_scale: float,
                     cfg: dict | None = None):
    """Pass 1 for queries q0 .. q0 + n - 1 (of B*T) into g [>= n, 2H, K] and, when p_sums is given, the head sums
    of P into p_sums [H / 64, >= n, K] fp32. q [B, T, H, 576], kv [B, S, 576], d_out / out [B, T, H, 512]
    contiguous, lse / d_lse [B, T, H] with unit last stride (d_lse None: no lse gradient), n_keys [B, T] int32
    contiguous. Inputs must pass `hopper_bwd_supports`. Returns the compiled kernel handle."""
    c = kernel_config(DS_CFG, cfg, "sparse MLA Hopper pass 1")
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    n_hblk = H // BLOCK_H
    n_work = n_hblk * n
    programs = min(n_work, c["PROGRAMS"] or _num_sms(q.device.index))
    dl = lse if d_lse is None else d_lse  # an unread placeholder without dlse
    ps = g if p_sums is None else p_sums  # an unread placeholder without the target
    return _sparse_mla_bwd_ds_hopper_kernel[(programs,)](
        q, kv, indices, n_keys, d_out, out, lse, dl, g, ps,
        q0, T, S, K, H, n_hblk, n_work, sm_scale, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        d_out.stride(0), d_out.stride(1), d_out.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), dl.stride(0), dl.stride(1), g.stride(0), g.stride(1), ps.stride(0), ps.stride(1),
        D_T=D_qk - 2 * HALF, HAS_DLSE=d_lse is not None, SUM_P=p_sums is not None,
        PRODUCER_WARPS=c["PRODUCER_WARPS"], PRODUCER_REGS=c["PRODUCER_REGS"], CONSUMER_REGS=c["CONSUMER_REGS"],
        num_warps=4,
    )
