"""Warp-specialised sparse MLA forward for Hopper (sm_90), written in Gluon (triton.experimental.gluon, triton 3.6).

Two schedules share the launcher `launch_hopper_fwd`: "seesaw" (the default, `hopper_seesaw.py`: the consumer
warpgroups alternate key blocks) and "lockstep" (this file's kernel, described here; it also owns the capability
rule and the Gluon helpers the seesaw and decode kernels reuse). Lock step: one CTA per (64-head block, query).
Roles inside the CTA:
- producer (a worker partition of PRODUCER_WARPS warps): gathers the query's selected latent rows, BLOCK_K at a time,
  with cp.async straight into a NUM_STAGES-deep ring of shared-memory tiles (value part [BLOCK_K, 512] and rope tail
  [BLOCK_K, 64]); each thread's copies arrive on the stage's `ready` mbarrier when they land (noinc arrive, so the
  barrier counts producer threads). It waits on the stage's `empty` mbarrier before overwriting it.
- consumers (the default partition, two warpgroups = 8 warps): S = Q.K^T by wgmma with Q [64, 576] resident in shared
  memory (warps [4, 2]: each warpgroup owns half of the BLOCK_K keys), online softmax in base 2 (the row max is
  reduced across the two warpgroups), P written once to shared memory in bf16, then O += P.V by wgmma where each
  warpgroup owns 256 of the 512 output columns (the [64, 512] fp32 accumulator is 128 registers per thread).
  A `thread_barrier` after both warpgroups' P.V completes lets one thread release the stage.
Both partitions run over the query's row blocks below its key extent n_keys[b, t] (1 + its last valid slot,
`triton_prefill.key_extent`), read once before the partitions split, so producer and consumers agree on the trip
count; a query with no valid key runs no block. Invalid indices (-1 or >= S, or past K) are not read (cp.async
zero-fills masked rows) and score -inf. A query with no valid key writes out = 0 and lse = -inf. Grids and buffers
depend on shapes only (CUDA-graph safe).

Gluon does not run in the CPU interpreter and its API moves between triton releases: this file targets triton 3.6
(`warp_specialize([(fn, args), ...], worker_warps, worker_regs)`). `hopper_fwd_supports` says when it applies.
"""
from __future__ import annotations

import functools

import torch
import triton

from .triton_prefill import key_extent

LOG2E = 1.4426950408889634
D_V_SUPPORTED = 512
D_TAIL_SUPPORTED = 64
BLOCK_H = 64

try:  # Gluon exists from triton 3.4; this module's kernels are written against 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    _GLUON_ERROR = None
    _BH = gl.constexpr(BLOCK_H)
except Exception as e:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton {triton.__version__} has no usable Gluon ({type(e).__name__}: {e})"


@functools.lru_cache(maxsize=1)
def _gluon_ok() -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    import inspect
    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[0] != "functions_and_args":  # 3.4/3.5 took (default_args, default_fn, worker_args, worker_fns, ...)
        return f"triton {triton.__version__}: Gluon warp_specialize has the pre-3.6 signature {params[:4]}"
    return None


def hopper_fwd_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if `sparse_mla_fwd_hopper` takes these inputs, else the reason it does not (no GPU needed to ask)."""
    return _device_reason(q) or _shape_reason(q, kv, indices, d_v) or _gluon_ok()


def _device_reason(q: torch.Tensor) -> str | None:
    """The Gluon kernels (this forward, `hopper_decode`) run on CUDA devices of compute capability 9.x."""
    if q.device.type != "cuda":
        return f"device {q.device.type} (the Gluon kernels run on CUDA sm_90 only)"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"compute capability {major}.{minor} (warp specialisation with setmaxnreg and wgmma need sm_90)"
    return None


def _shape_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, block_h: int = BLOCK_H,
                  why_h: str = "one wgmma M tile per head block") -> str | None:
    """The device-independent part of the capability rule (tested on CPU); heads in blocks of `block_h`."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        return f"ranks q={q.dim()} kv={kv.dim()} indices={indices.dim()} (want 4, 3, 3)"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (want bf16 or fp16, equal)"
    if d_v != D_V_SUPPORTED or q.shape[-1] != D_V_SUPPORTED + D_TAIL_SUPPORTED or kv.shape[-1] != q.shape[-1]:
        return f"d_v={d_v}, d_qk={q.shape[-1]}, kv d={kv.shape[-1]} (want d_v 512, d_qk 576: DeepSeek MLA)"
    if q.shape[2] % block_h != 0:
        return f"H={q.shape[2]} (want a multiple of {block_h}: {why_h})"
    if indices.dtype != torch.int32:
        return f"indices dtype {indices.dtype} (want int32)"
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1:
        return "q, kv and indices need contiguous last dims"
    if any(st % 8 for st in (*q.stride()[:3], *kv.stride()[:2])):
        return "q and kv strides must be multiples of 8 elements (16-byte row starts for cp.async)"
    if kv.shape[1] == 0 or indices.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return "empty kv, indices or queries"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _issue_rows(smem, kv_base, idx, S, s_kvs, col0, offs_d, mask_cols):
        """cp.async the rows kv_base[idx] (columns col0 + offs_d) into one stage tile; invalid rows zero-filled."""
        ok = (idx >= 0) & (idx < S)
        rows = kv_base + gl.where(ok, idx, 0).to(gl.int64) * s_kvs + col0
        ptrs = gl.max_contiguous(gl.multiple_of(rows[:, None] + offs_d[None, :], [1, 16]), [1, 8])
        async_copy.async_copy_global_to_shared(smem, ptrs, mask=ok[:, None] & mask_cols[None, :])

    @gluon.jit
    def _producer(kv_ptr, idx_ptr, kn_smem, kr_smem, ready, empty, b, t, S, K, n_k, s_kvb, s_kvs, s_ib, s_it,
                  BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_T: gl.constexpr, NUM_STAGES: gl.constexpr,
                  PRODUCER_WARPS: gl.constexpr, DIAG: gl.constexpr):
        """Gather rows of kv into the stage ring with cp.async; every thread arrives (noinc) on `ready`.
        The next block's indices are loaded before waiting for a free stage, so their global-load latency is off
        the critical path (the copies cannot start before the indices are known)."""
        s_kvb = gl.multiple_of(s_kvb, 8)  # checked by hopper_fwd_supports: 16-byte cp.async per thread
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
            if DIAG != 1:  # DIAG 1 (timing only): no copies, the consumer reads stale tiles
                _issue_rows(kn_smem.index(s), kv_base, idx_n, S, s_kvs, 0, offs_dv, all_v)
                _issue_rows(kr_smem.index(s), kv_base, idx_r, S, s_kvs, D_V, offs_dt, all_t)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            idx_n = nxt_n
            idx_r = nxt_r

    @gluon.jit
    def _qk(qn_smem, qr_smem, kn_smem, kr_smem, ready, it, s_zero, NUM_STAGES: gl.constexpr):
        """Wait for row block `it`, then issue S = Q_nope.K_nope^T + Q_rope.K_rope^T asynchronously (a token)."""
        st = it % NUM_STAGES
        mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy
        sc = warpgroup_mma(qn_smem, kn_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return warpgroup_mma(qr_smem, kr_smem.index(st).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _softmax_pv(sc, it, idx_base, S, K, m_i, l_i, acc, p_smem, kn, scale_log2,
                    BLOCK_K: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr):
        """Online softmax of one S block (base 2), P to shared memory, then O += P.V issued asynchronously."""
        offs_k = it * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
        idx = gl.load(idx_base + offs_k, mask=offs_k < K, other=-1)
        valid = (idx >= 0) & (idx < S)
        sc = gl.where(valid[None, :], sc * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exp2 finite
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        p_smem.store(p.to(p_smem.dtype))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' halves of P are written before either reads it
        acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
        return m_new, l_i, acc

    @gluon.jit
    def _consumer(qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr,
                  b, t, h0, S, K, n_k, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2,
                  BLOCK_K: gl.constexpr, D_V: gl.constexpr, NUM_STAGES: gl.constexpr, DIAG: gl.constexpr):
        """Two warpgroups: S by wgmma, softmax, P to shared memory, O += P.V by wgmma; then the epilogue."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_K // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D_V // 2, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        idx_base = idx_ptr + b * s_ib + t * s_it
        m_i = gl.full([_BH], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_BH], gl.float32, row_s)
        acc = gl.zeros([_BH, D_V], gl.float32, o_l)
        s_zero = gl.zeros([_BH, BLOCK_K], gl.float32, s_l)
        n_blocks = gl.cdiv(n_k, BLOCK_K)  # the producer's count
        if DIAG == 2:  # timing only: the producer alone (no MMA, no softmax)
            for it in range(n_blocks):
                st = it % NUM_STAGES
                mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
                gl.thread_barrier()
                mbarrier.arrive(empty.index(st), count=1)
        else:
            for it in range(n_blocks):
                st = it % NUM_STAGES
                sc_tok = _qk(qn_smem, qr_smem, kn_smem, kr_smem, ready, it, s_zero, NUM_STAGES)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc_tok, ))
                m_i, l_i, acc = _softmax_pv(sc, it, idx_base, S, K, m_i, l_i, acc, p_smem, kn_smem.index(st),
                                            scale_log2, BLOCK_K, s_l, o_l)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()  # both warpgroups are done with this stage (and with P)
                mbarrier.arrive(empty.index(st), count=1)
        _epilogue(acc, m_i, l_i, qn_smem, out_ptr, lse_ptr, b, t, h0, s_ob, s_ot, s_oh, s_lb, s_lt, D_V, s_l, o_l)

    @gluon.jit
    def _epilogue(acc, m_i, l_i, qn_smem, out_ptr, lse_ptr, b, t, h0, s_ob, s_ot, s_oh, s_lb, s_lt,
                  D_V: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr):
        """Normalise, stage the bf16 tile through Q's (now dead) shared memory, store it coalesced; lse in ln."""
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        out = (acc / l_safe[:, None]).to(qn_smem.dtype)
        gl.thread_barrier()  # every warpgroup's last wgmma read of Q is complete
        qn_smem.store(out)
        gl.thread_barrier()
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        tile = qn_smem.load(st_l)
        rows = gl.arange(0, _BH, layout=gl.SliceLayout(1, st_l))
        cols = gl.arange(0, D_V, layout=gl.SliceLayout(0, st_l))
        o_ptrs = out_ptr + b * s_ob + t * s_ot + (h0 + rows).to(gl.int64)[:, None] * s_oh + cols[None, :]
        gl.store(o_ptrs, tile)
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
        lrows = gl.arange(0, _BH, layout=gl.SliceLayout(1, s_l))
        gl.store(lse_ptr + b * s_lb + t * s_lt + h0 + lrows, lse)

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
        """Shared memory of both Gluon kernels: Q (value part, rope tail), the ring of gathered rows, P, and the
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
        s_qb = gl.multiple_of(s_qb, 8)  # hopper_fwd_supports checks: every row starts on 16 bytes
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
    def _hopper_fwd_kernel(
        q_ptr, kv_ptr, idx_ptr, nk_ptr, out_ptr, lse_ptr,
        T, S, K, n_hblk, scale_log2,
        s_qb, s_qt, s_qh, s_kvb, s_kvs, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt,
        BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_T: gl.constexpr, NUM_STAGES: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DIAG: gl.constexpr, KEY_EXTENT: gl.constexpr,
    ):
        qi, b, t, h0 = _program_query(n_hblk, T, _BH)
        if KEY_EXTENT:
            n_k = gl.load(nk_ptr + qi)  # key extent: both partitions take this one value as their trip count
        else:  # every slot (the round-4 kernel)
            n_k = K
        dtype: gl.constexpr = q_ptr.dtype.element_ty

        qn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, D_V], dtype)
        qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, D_T], dtype)
        kn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
        kr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_T], dtype)
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, BLOCK_K], dtype)
        qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty = _alloc_tiles(
            dtype, _BH, BLOCK_K, D_V, D_T, NUM_STAGES, PRODUCER_WARPS, qn_l, qr_l, kn_l, kr_l, p_l)
        _load_q(q_ptr, qn_smem, qr_smem, b, t, h0, s_qb, s_qt, s_qh, _BH, D_V, D_T, 8)

        gl.warp_specialize(
            [
                (_consumer, (qn_smem, qr_smem, kn_smem, kr_smem, p_smem, ready, empty, idx_ptr, out_ptr, lse_ptr,
                             b, t, h0, S, K, n_k, s_ib, s_it, s_ob, s_ot, s_oh, s_lb, s_lt, scale_log2,
                             BLOCK_K, D_V, NUM_STAGES, DIAG)),
                (_producer, (kv_ptr, idx_ptr, kn_smem, kr_smem, ready, empty, b, t, S, K, n_k, s_kvb, s_kvs, s_ib, s_it,
                             BLOCK_K, D_V, D_T, NUM_STAGES, PRODUCER_WARPS, DIAG)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )


# The lock-step schedule (this file's kernel). PRODUCER_REGS 96 leaves the consumers 208 registers (Triton splits
# the 168 x 384 launch budget); DIAG 1 / 2 are timing-only diagnostics (no copies / no math) whose outputs are wrong.
# KEY_EXTENT 0 loops over all K slots whatever n_keys says (correct, slower on causal top-k rows).
LOCKSTEP_CFG = dict(BLOCK_K=64, NUM_STAGES=2, PRODUCER_WARPS=4, PRODUCER_REGS=96, DIAG=0, KEY_EXTENT=1)
# "seesaw" (hopper_seesaw.py) is faster on an H200 at every context measured (docs/kernels.md item 24);
# "lockstep" stays selectable through cfg={"SCHEDULE": "lockstep", ...}.
SCHEDULES = ("seesaw", "lockstep")
DEFAULT_SCHEDULE = "seesaw"


def launch_hopper_fwd(q, kv, indices, sm_scale, d_v, out, lse, cfg: dict | None = None, n_keys=None):
    """Fill out [B, T, H, 512] and lse [B, T, H] fp32 (both with unit last stride) for inputs that
    `hopper_fwd_supports` accepts; n_keys [B, T] int32 contiguous = `key_extent(indices, S)` (computed when not
    given). cfg: SCHEDULE ("seesaw" | "lockstep") plus that schedule's knobs. Returns the compiled kernel handle
    (registers, spills)."""
    assert out.stride(-1) == 1 and lse.stride(-1) == 1, "out and lse need unit last strides"
    c = dict(cfg or {})
    schedule = c.pop("SCHEDULE", DEFAULT_SCHEDULE)
    if schedule not in SCHEDULES:
        raise ValueError(f"sparse MLA Hopper forward: SCHEDULE={schedule!r} (known: {SCHEDULES})")
    if schedule == "seesaw":
        from .hopper_seesaw import SEESAW_CFG, launch_seesaw_fwd
        if not c.get("KEY_EXTENT", SEESAW_CFG["KEY_EXTENT"]):
            n_keys = indices  # a placeholder pointer, never read
        elif n_keys is None:
            n_keys = key_extent(indices, kv.shape[1])
        return launch_seesaw_fwd(q, kv, indices, sm_scale * LOG2E, out, lse, n_keys, c)
    c = dict(LOCKSTEP_CFG, **c)
    unknown = set(c) - set(LOCKSTEP_CFG)
    if unknown:
        raise ValueError(f"sparse MLA Hopper forward (lockstep): unknown config keys {sorted(unknown)} "
                         f"(known: {sorted(LOCKSTEP_CFG)})")
    B, T, H, D_qk = q.shape
    S, K = kv.shape[1], indices.shape[2]
    if not c["KEY_EXTENT"]:
        n_keys = indices  # a placeholder pointer, never read
    elif n_keys is None:
        n_keys = key_extent(indices, S)
    n_hblk = H // BLOCK_H
    grid = (n_hblk * B * T,)
    return _hopper_fwd_kernel[grid](
        q, kv, indices, n_keys, out, lse,
        T, S, K, n_hblk, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        BLOCK_K=c["BLOCK_K"], D_V=d_v, D_T=D_qk - d_v, NUM_STAGES=c["NUM_STAGES"],
        PRODUCER_WARPS=c["PRODUCER_WARPS"], PRODUCER_REGS=c["PRODUCER_REGS"], DIAG=c["DIAG"],
        KEY_EXTENT=c["KEY_EXTENT"], num_warps=8,
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
