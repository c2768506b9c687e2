"""Warp-specialised sparse MLA decode for Hopper (Gluon, triton 3.6) for few heads per query: one CTA per 16 heads
(H a multiple of 16); the dispatcher (`dispatch.py`, kernel "hopper_decode") takes it for exactly 16, a TP-8 shard.

Decode moves each query's selected latent rows once (2048 x 1152 bytes per query at topk 2048) and does little math
on them, so its speed is how many row gathers stay in flight. The portable kernel (`triton_decode`) issues a block's
gathers only when its loop reaches the block, so an SM has about one block in flight. Here one CTA per (query, head
block of 16) runs:
- the producer partition (`_producer`): cp.async gathers of BLOCK_K rows into a NUM_STAGES-deep ring,
  running ahead of the math by up to the whole ring (2 x 64 rows = 144 KB);
- the consumer (4 warps): S = Q K^T and O += P V with warp-level MMAs (mma.sync m16n8k16: 16 heads are one M tile;
  a warpgroup MMA needs 64 rows), the key columns of S and the value columns of O split over the 4 warps; online
  softmax in base 2 with per-thread partial row sums (reduced once at the end); P through shared memory.
One split per query: no partial outputs and no combine kernel. Same contract as `sparse_mla` for no-grad calls.
"""
from __future__ import annotations

import torch

from .hopper_common import GLUON_ERROR, LOG2E, device_reason, gluon_reason, kernel_config, shape_reason

DECODE_BLOCK_H = 16
# 64-row blocks in 2 stages beat 32-row blocks in 4-5 stages on an H200 (fewer blocks: fewer consumer barriers per
# row; docs/kernels.md)
DECODE_CFG = dict(BLOCK_K=64, NUM_STAGES=2, PRODUCER_WARPS=4, PRODUCER_REGS=96)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from .hopper_common import issue_rows

    _DBH = gl.constexpr(DECODE_BLOCK_H)

    @gluon.jit
    def _producer(kv_ptr, idx_ptr, kn_smem, kr_smem, ready, empty, b, t, S, K, n_k, s_kvb, s_kvs, s_ib, s_it,
                  BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_T: gl.constexpr, NUM_STAGES: gl.constexpr,
                  PRODUCER_WARPS: gl.constexpr):
        """Gather rows of kv into the stage ring with cp.async; every thread arrives (noinc) on `ready`.
        The next block's indices are loaded before waiting for a free stage, so their global-load latency is off
        the critical path (the copies cannot start before the indices are known)."""
        s_kvb = gl.multiple_of(s_kvb, 8)  # checked by shape_reason: 16-byte cp.async per thread
        s_kvs = gl.multiple_of(s_kvs, 8)
        nope_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
        rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        offs_dv = gl.arange(0, D_V, layout=gl.SliceLayout(0, nope_l))
        offs_dt = gl.arange(0, D_T, layout=gl.SliceLayout(0, rope_l))
        all_v = offs_dv < D_V
        all_t = offs_dt < D_T
        kv_base = kv_ptr + b * s_kvb
        idx_base = idx_ptr + b * s_ib + t * s_it
        offs_n = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, nope_l))
        offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rope_l))
        idx_n = gl.load(idx_base + offs_n, mask=offs_n < K, other=-1)
        idx_r = gl.load(idx_base + offs_r, mask=offs_r < K, other=-1)
        n_blocks = gl.cdiv(n_k, BLOCK_K)  # the consumers run the same count (n_k is read once, before the split)
        for it in range(n_blocks):
            s = it % NUM_STAGES
            k1 = (it + 1) * BLOCK_K
            nxt_n = gl.load(idx_base + k1 + offs_n, mask=k1 + offs_n < K, other=-1)  # prefetch block it + 1
            nxt_r = gl.load(idx_base + k1 + offs_r, mask=k1 + offs_r < K, other=-1)
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # fresh barrier: parity 1 passes at once
            issue_rows(kn_smem.index(s), kv_base, idx_n, S, s_kvs, 0, offs_dv, all_v)
            issue_rows(kr_smem.index(s), kv_base, idx_r, S, s_kvs, D_V, offs_dt, all_t)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            idx_n = nxt_n
            idx_r = nxt_r

    @gluon.jit
    def _program_query(n_hblk, T, BH: gl.constexpr):
        """Program id -> (query index, b, t, first head): 1-D grid (no 65,535 limit), a query's head blocks adjacent
        so they share its gathered rows in L2."""
        pid = gl.program_id(0)
        qi = (pid // n_hblk).to(gl.int64)
        return qi, qi // T, qi % T, (pid % n_hblk) * BH

    @gluon.jit
    def _alloc_tiles(dtype: gl.constexpr, BH: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                     D_T: gl.constexpr, NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, qn_l: gl.constexpr,
                     qr_l: gl.constexpr, kn_l: gl.constexpr, kr_l: gl.constexpr, p_l: gl.constexpr):
        """Shared memory of the decode kernel: Q (value part, rope tail), the ring of gathered rows, P, and the
        ring's mbarriers: `ready[s]` completes when every producer thread's copies into stage s have landed (noinc
        arrivals), `empty[s]` when the consumer partition is done with it."""
        qn_smem = gl.allocate_shared_memory(dtype, [BH, D_V], qn_l)
        qr_smem = gl.allocate_shared_memory(dtype, [BH, D_T], qr_l)
        kn_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_V], kn_l)
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, D_T], kr_l)
        p_smem = gl.allocate_shared_memory(dtype, [BH, BLOCK_K], p_l)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        return qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty

    @gluon.jit
    def _load_q(q_ptr, qn_smem, qr_smem, b, t, h0, s_qb, s_qt, s_qh, BH: gl.constexpr, D_V: gl.constexpr,
                D_T: gl.constexpr, WARPS: gl.constexpr):
        """Q [BH, D_V + D_T] of this program's head block into shared memory (plain loads, every warp), visible to
        the tensor cores and to every partition once this returns."""
        s_qb = gl.multiple_of(s_qb, 8)  # shape_reason checks: every row starts on 16 bytes
        s_qt = gl.multiple_of(s_qt, 8)
        s_qh = gl.multiple_of(s_qh, 8)
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        qtl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        q_base = q_ptr + b * s_qb + t * s_qt + h0.to(gl.int64) * s_qh
        rq = gl.arange(0, BH, layout=gl.SliceLayout(1, ql))
        cq = gl.arange(0, D_V, layout=gl.SliceLayout(0, ql))
        qn_smem.store(gl.load(q_base + rq[:, None] * s_qh + cq[None, :]))
        rt = gl.arange(0, BH, layout=gl.SliceLayout(1, qtl))
        ct = gl.arange(0, D_T, layout=gl.SliceLayout(0, qtl))
        qr_smem.store(gl.load(q_base + rt[:, None] * s_qh + D_V + ct[None, :]))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _decode_consumer(qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr,
                         b, t, h0, S, K, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2,
                         BLOCK_K: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr):
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        idx_base = idx_ptr + b * s_ib + t * s_it
        m_i = gl.full([_DBH], float("-inf"), gl.float32, row_l)
        l_part = gl.zeros([_DBH, BLOCK_K], gl.float32, mma_l)  # row sums kept per thread, reduced at the end
        acc = gl.zeros([_DBH, D_V], gl.float32, mma_l)
        for it in range(gl.cdiv(K, BLOCK_K)):
            st = it % NUM_STAGES
            mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
            kn = kn_smem.index(st)
            sc = gl.zeros([_DBH, BLOCK_K], gl.float32, mma_l)
            for c in gl.static_range(D_V // 64):  # the value part in 64-column chunks (registers), then the tail
                sc = mma_v2(qn_smem.slice(64 * c, 64, dim=1).load(a_l),
                            kn.slice(64 * c, 64, dim=1).permute((1, 0)).load(b_l), sc)
            sc = mma_v2(qr_smem.load(a_l), kr_smem.index(st).permute((1, 0)).load(b_l), sc)
            offs_k = it * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, mma_l))
            idx = gl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
            valid = (idx >= 0) & (idx < S)
            sc = gl.where(valid[None, :], sc * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc - m_safe[:, None])
            l_part = l_part * alpha[:, None] + p
            gl.thread_barrier()  # every warp has read the previous block's P
            p_smem.store(p.to(p_smem.dtype))
            gl.thread_barrier()
            v = kn.load(b_l)
            gl.thread_barrier()  # every warp holds its rows of this stage in registers: release it
            mbarrier.arrive(empty.index(st), count=1)
            acc = mma_v2(p_smem.load(a_l), v, acc * alpha[:, None])
            m_i = m_new
        l_i = gl.sum(l_part, 1)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        rows = gl.arange(0, _DBH, layout=row_l)
        cols = gl.arange(0, D_V, layout=gl.SliceLayout(0, mma_l))
        o_ptrs = out_ptr + b * s_ob + t * s_ot + (h0 + rows).to(gl.int64)[:, None] * s_oh + cols[None, :]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(lse_ptr + b * s_lb + t * s_lt + h0 + rows, lse)

    @gluon.jit
    def _hopper_decode_kernel(
        q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
        T, S, K, n_hblk, scale_log2,
        s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt,
        BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_T: gl.constexpr, NUM_STAGES: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        qi, b, t, h0 = _program_query(n_hblk, T, _DBH)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        tile_l: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])  # ldmatrix-friendly, 64-column period
        qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty = _alloc_tiles(
            dtype, _DBH, BLOCK_K, D_V, D_T, NUM_STAGES, PRODUCER_WARPS, tile_l, tile_l, tile_l, tile_l, tile_l)
        _load_q(q_ptr, qn_smem, qr_smem, b, t, h0, s_qb, s_qt, s_qh, _DBH, D_V, D_T, 4)
        gl.warp_specialize(
            [
                (_decode_consumer, (qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr,
                                    lse_ptr, b, t, h0, S, K, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2,
                                    BLOCK_K, D_V, NUM_STAGES)),
                (_producer, (kv_ptr, idx_ptr, kn_smem, kr_smem, ready, empty, b, t, S, K, K, s_kvb, s_kvs, s_ib, s_it,
                             BLOCK_K, D_V, D_T, NUM_STAGES, PRODUCER_WARPS)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )


def hopper_decode_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if `sparse_mla_decode_hopper` takes these inputs, else the reason it does not: the Gluon forward's rule
    (`hopper_common.shape_reason`) with heads in blocks of 16."""
    return (device_reason(q) or shape_reason(q, kv, indices, d_v, DECODE_BLOCK_H, "one MMA tile of heads per program")
            or gluon_reason())


def sparse_mla_decode_hopper(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, cfg: dict | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode forward on sm_90: q [B, T, H, 576] (H a multiple of 16), kv [B, S, 576] (a cache), indices [B, T, K]
    int32 (-1 / >= S: no key) -> out [B, T, H, 512] q.dtype, lse [B, T, H] fp32 (written into `out` / `lse` when
    given). Raises ValueError with the reason when `hopper_decode_supports` refuses the inputs."""
    reason = hopper_decode_supports(q, kv, indices, d_v)
    if reason is not None:
        raise ValueError(f"sparse_mla_decode_hopper: {reason}")
    c = kernel_config(DECODE_CFG, cfg, "sparse_mla_decode_hopper")
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    out = torch.empty(B, T, H, d_v, device=q.device, dtype=q.dtype) if out is None else out
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if lse is None else lse
    if out.shape != (B, T, H, d_v) or lse.shape != (B, T, H) or out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError(f"sparse_mla_decode_hopper: out {tuple(out.shape)} / lse {tuple(lse.shape)} must be "
                         f"{(B, T, H, d_v)} / {(B, T, H)} with unit last strides")
    n_hblk = H // DECODE_BLOCK_H
    _hopper_decode_kernel[(n_hblk * B * T,)](
        q, kv, indices, out, lse, T, S, K, n_hblk, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        BLOCK_K=c["BLOCK_K"], D_V=d_v, D_T=D_qk - d_v, NUM_STAGES=c["NUM_STAGES"],
        PRODUCER_WARPS=c["PRODUCER_WARPS"], PRODUCER_REGS=c["PRODUCER_REGS"], num_warps=4,
    )
    return out, lse
