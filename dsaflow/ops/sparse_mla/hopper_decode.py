"""Warp-specialised sparse MLA decode for Hopper (Gluon, triton 3.6) for few heads per query: one CTA per 16 heads
(H a multiple of 16); the dispatcher (`triton_dispatch.select_decode`) takes it for exactly 16, a TP-8 shard.

Decode moves each query's selected latent rows once (2048 x 1152 bytes per query at topk 2048) and does little math
on them, so its speed is how many row gathers stay in flight. The portable kernel (`triton_decode`) issues a block's
gathers only when its loop reaches the block, so an SM has about one block in flight. Here one CTA per (query, head
block of 16) runs:
- the producer partition (`hopper_prefill._producer`): cp.async gathers of BLOCK_K rows into a NUM_STAGES-deep ring,
  running ahead of the math by up to the whole ring (2 x 64 rows = 144 KB);
- the consumer (4 warps): S = Q K^T and O += P V with warp-level MMAs (mma.sync m16n8k16: 16 heads are one M tile;
  a warpgroup MMA needs 64 rows), the key columns of S and the value columns of O split over the 4 warps; online
  softmax in base 2 with per-thread partial row sums (reduced once at the end); P through shared memory.
One split per query: no partial outputs and no combine kernel. Same contract as `sparse_mla` for no-grad calls.
"""
from __future__ import annotations

import torch

from .hopper_prefill import _GLUON_ERROR, LOG2E, _device_reason, _gluon_ok, _shape_reason

DECODE_BLOCK_H = 16
# H200, 128 seqs x 1 token x 16 heads, 32K cache, topk 2048 (docs/kernels.md): 64-row blocks in 2 stages 86.0 us
# (85 % of copy) against 91 us for 32-row blocks in 4-5 stages (fewer blocks: fewer consumer barriers per row)
DECODE_CFG = dict(BLOCK_K=64, NUM_STAGES=2, PRODUCER_WARPS=4, PRODUCER_REGS=96)

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from .hopper_prefill import _alloc_tiles, _load_q, _producer, _program_query

    _DBH = gl.constexpr(DECODE_BLOCK_H)

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
                             BLOCK_K, D_V, D_T, NUM_STAGES, PRODUCER_WARPS, 0)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )


def hopper_decode_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if `sparse_mla_decode_hopper` takes these inputs, else the reason it does not: the forward's rule
    (`hopper_prefill`) with heads in blocks of 16."""
    return (_device_reason(q) or _shape_reason(q, kv, indices, d_v, DECODE_BLOCK_H, "one MMA tile of heads per program")
            or _gluon_ok())


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
    c = dict(DECODE_CFG, **(cfg or {}))
    unknown = set(c) - set(DECODE_CFG)
    if unknown:
        raise ValueError(f"sparse_mla_decode_hopper: unknown config keys {sorted(unknown)} "
                         f"(known: {sorted(DECODE_CFG)})")
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
