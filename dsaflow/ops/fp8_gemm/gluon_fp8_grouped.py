"""The grouped block-scaled FP8 GEMM for Hopper (sm_90), written in Gluon: the contract of `triton_fp8_grouped`
(rows sorted by expert, x8 [M_pad, K] e4m3 with scales x_scale_t [ceil(K / 128), M_pad], w8 [E, N, K] e4m3 with
w_scale [E, ceil(N / 128), ceil(K / 128)], offsets int32 [E] -> [M, N], rows past offsets[-1] zero), with the tensor
cores' MMA of K block kb + 1 running while the CUDA cores scale K block kb, as DeepGEMM does.

Why: each K block's product must be scaled by a_scale[rows, kb] x w_scale[e, n // 128, kb] and added to the fp32
accumulator on the CUDA cores (the recipe's promotion). Triton waits for every block's MMA before that scaling
(`wgmma.wait_group 0`), so the tensor cores idle during each promotion. Here every K block's MMA is issued before the
previous one is retired (`warpgroup_mma_wait(num_outstanding=1)`): one MMA group is always in flight.

Roles, per output tile of 128 rows (one row tile of `moe.triton_grouped.tile_table`) x 128 columns (one weight-scale
block, so the weight scale is one scalar per K block):
  producer   (one warp) copies each K block's operands with TMA into a STAGES-deep shared-memory ring: A as two
             [64, 128] boxes at rows row0 and row0 + 64 of x8 (any row: the rows past the tile's end belong to the
             next expert or lie past M_pad, where TMA fills zeros; they are never stored; the second box only when
             the tile has more than 64 rows), B as one [128, 128] box of w8 viewed as [E * N, K] at row e * N + n0.
             K and N past the tensor are zero-filled by TMA, so partial blocks need no mask. Each slot has a ready
             mbarrier (TMA's byte count) and an empty one (both consumers' arrivals).
  consumer c (c = 0, 1: two warpgroups, rows 64 c .. 64 c + 63 of the tile) issues block kb + 1's MMA into a dead
             register tile (use_acc=False), retires block kb's, releases its slot, and adds it times its scales into
             the fp32 accumulator. Registers: the accumulator, the product being promoted and the one in flight,
             64 fp32 each per thread. Each block's scales are loaded one block ahead (off the MMA's path).
Half tiles: an expert's ragged last tile of at most 64 rows (with about 256 rows per expert, every other expert
has one) is split by columns instead, warpgroup c taking its 64 rows times columns 64 c .. 64 c + 63, so it costs
half a tile; a warpgroup is bound by its own chain of MMA and promotion, so one warpgroup alone on the 64 rows
would take as long as a full tile. The K loop and the accumulation order are the same, so results are too.
Persistent programs (K at most `PERSISTENT_MAX_K`): one program per SM walks the tile slots (program_id,
+ num_programs, ...), the ring running on from one tile into the next: that pays at the down projection's 16 K
blocks and costs at gate_up's 56, where the programs drift apart and share fewer operand tiles in L2 than the
hardware's in-order launch of one program per tile. Tiles of the group past the last expert (the table's group E)
write zeros; slots past the last tile are skipped.
The grid and the buffers depend on shapes only, so CUDA graphs capture the launch and nothing syncs the host.
Requires K % 16 == 0 (TMA's 16-byte row pitch): `gluon_support_reason` says why a call cannot run here.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..sparse_mla.hopper_common import GLUON_ERROR, gluon_reason, kernel_config
from .naive import BLOCK, FP8

# STAGES: shared-memory ring slots (32 KB each); GROUP_M: row tiles walked together across the column tiles (L2);
# PERSISTENT_MAX_K: one program per SM for K up to this (the module docstring), else one per tile slot
GLUON_CFG = dict(STAGES=6, GROUP_M=8, CONSUMER_REGS=232, PRODUCER_REGS=40, PERSISTENT_MAX_K=2048)
BLOCK_M = 128  # rows per tile: two consumer warpgroups of 64 (the table's row block)
HALF_M = 64
BLOCK_N = 128  # one weight-scale block

TMA_ERROR = GLUON_ERROR
if GLUON_ERROR is None:
    try:  # the TMA names: triton 3.6 has async_copy_global_to_shared, later releases async_load
        from triton.experimental.gluon.language.nvidia.hopper import tma as _tma_mod
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        if not (hasattr(_tma_mod, "async_load") or hasattr(_tma_mod, "async_copy_global_to_shared")):
            raise ImportError("no TMA load (async_load / async_copy_global_to_shared)")
    except Exception as e:  # pragma: no cover - depends on the installed triton
        TMA_ERROR = f"triton {triton.__version__} has no usable Gluon TMA ({type(e).__name__}: {e})"

if TMA_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    _BM = gl.constexpr(BLOCK_M)
    _HM = gl.constexpr(HALF_M)
    _BN = gl.constexpr(BLOCK_N)
    _BK = gl.constexpr(BLOCK)
    _HN = gl.constexpr(BLOCK_N // 2)
    # one consumer warpgroup's accumulator [64, 128] (fp8 wgmma: K 32 per instruction), and [64, 64] in a half tile
    _ACC_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
    _ACC_H = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
    # the output's stores: 16 bytes (bf16) per thread, a 128-column row per 16 threads (a 64-column one per 8)
    _OUT_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
    _OUT_H = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    if hasattr(tma, "async_load"):

        @gluon.jit
        def _tma_load(desc, row, col, bar, smem, pred):
            """One box of desc at (row, col) into smem, counted on bar (nothing when pred is false)."""
            tma.async_load(desc, [row, col], bar, smem, pred)

    else:  # triton 3.6

        @gluon.jit
        def _tma_load(desc, row, col, bar, smem, pred):
            """One box of desc at (row, col) into smem, counted on bar (nothing when pred is false)."""
            tma.async_copy_global_to_shared(desc, [row, col], bar, smem, pred)

    if hasattr(gl, "thread_barrier"):  # triton 3.6

        @gluon.jit
        def _sync():
            """A barrier over this partition's (or before warp_specialize the CTA's) threads."""
            gl.thread_barrier()

    else:  # later releases call it barrier

        @gluon.jit
        def _sync():
            """A barrier over this partition's (or before warp_specialize the CTA's) threads."""
            gl.barrier()

    @gluon.jit
    def _release(bar):
        """Every thread of this warpgroup is done with a ring slot (its MMA waits): one arrival on bar."""
        _sync()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _swizzled_tile(pid, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """`moe.triton_grouped.swizzled_tile` in Gluon: (row tile, column tile) of program pid, GROUP_M row tiles
        walked together across all column tiles."""
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @gluon.jit
    def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row0_ptr, tile_rowend_ptr,
                  N, n_kb, tiles_m, tiles_n, E: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Each of this program's tiles in turn: each K block's A rows (two [64, 128] boxes; the second only when
        the tile has rows past its first 64) and B rows ([128, 128]) into the next ring slot, once both consumers
        released it. The ring runs on across tiles (position `i`), so the next tile's first blocks load while
        the consumers finish and store the last one."""
        both: gl.constexpr = _BM * _BK + _BN * _BK  # fp8: one byte an element; TMA counts zero-filled bytes too
        first_half: gl.constexpr = _HM * _BK + _BN * _BK
        i = gl.program_id(0) * 0  # ring position: K blocks loaded so far by this program
        for slot in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            tile, pid_n = _swizzled_tile(slot, tiles_m, tiles_n, GROUP_M)
            e = gl.load(tile_expert_ptr + tile)
            if e < E:
                row0 = gl.load(tile_row0_ptr + tile)
                row_end = gl.load(tile_rowend_ptr + tile)
                two_halves = row0 + _HM < row_end
                first_only = row0 + _HM >= row_end
                b_row = e * N + pid_n * _BN
                for kb in range(n_kb):
                    s = i % STAGES
                    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
                    mbarrier.expect(ready.index(s), both, two_halves)
                    mbarrier.expect(ready.index(s), first_half, first_only)
                    k0 = kb * _BK
                    _tma_load(a_desc, row0, k0, ready.index(s), a_smem.index(2 * s), True)
                    _tma_load(a_desc, row0 + _HM, k0, ready.index(s), a_smem.index(2 * s + 1), two_halves)
                    _tma_load(b_desc, b_row, k0, ready.index(s), b_smem.index(s), True)
                    i += 1

    @gluon.jit
    def _block_scale(a_sc, b_sc, kb, s_ask, s_bsk):
        """a_scale[rows, kb] * w_scale[e, n // 128, kb]: K block kb's promotion factors for this warpgroup's rows."""
        return gl.load(a_sc + kb * s_ask) * gl.load(b_sc + kb * s_bsk)

    @gluon.jit
    def _free_after(dead, acc):
        """dead's registers (tied: nothing is emitted), available only once acc is computed. Without it LLVM moves
        a block's promotion (acc += p * scale, which reads p) below the next MMA that reuses p's registers, so it
        copies p, and ptxas, seeing registers of an MMA in flight copied, serializes every wgmma of the kernel."""
        return gl.inline_asm_elementwise("", "=r,0,r", [dead, acc], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _issue(a_smem, b_smem, ready, c, i, dead, STAGES: gl.constexpr, HALF: gl.constexpr):
        """Wait for ring position i's slot, start its MMA into the registers of `dead` (use_acc=False): one async
        group. A full tile: this warpgroup's 64 rows (A box c) times the 128 columns; a half tile: the one A box
        times this warpgroup's 64 of the columns."""
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if HALF:
            a = a_smem.index(2 * s)
            b = b_smem.index(s).slice(c * _HN, _HN)
        else:
            a = a_smem.index(2 * s + c)
            b = b_smem.index(s)
        return warpgroup_mma(a, b.permute((1, 0)), dead, use_acc=False, is_async=True)

    @gluon.jit
    def _tile_product(c, a_smem, b_smem, ready, empty, a_sc, b_sc, i0, n_kb, s_ask, s_bsk, STAGES: gl.constexpr,
                      HALF: gl.constexpr, WIDTH: gl.constexpr, ACC_L: gl.constexpr):  # fmt: skip
        """This warpgroup's [64, WIDTH] fp32 product (`_issue`'s operands; ACC_L its layout) over the n_kb K blocks
        at ring positions i0 ..: block kb + 1's MMA in flight while block kb is scaled and added; every slot released
        once its MMA retired.

        Two register tiles X, Y take the even and the odd K blocks, and the loop runs two blocks an iteration, so
        each product stays in its registers from the MMA through the promotion: a loop rotating one tile into
        another makes the compiler copy registers of an MMA in flight, and ptxas then serializes every wgmma.
        Block kb's scales are loaded at least a block before its promotion."""
        last = n_kb - 1
        acc = gl.zeros([_HM, WIDTH], gl.float32, ACC_L)
        px = gl.zeros([_HM, WIDTH], gl.float32, ACC_L)  # X: the even blocks' products
        py = gl.zeros([_HM, WIDTH], gl.float32, ACC_L)  # Y: the odd blocks'
        sx = _block_scale(a_sc, b_sc, 0, s_ask, s_bsk)
        sy = _block_scale(a_sc, b_sc, gl.minimum(1, last), s_ask, s_bsk)
        tok_x = _issue(a_smem, b_smem, ready, c, i0, px, STAGES, HALF)
        for j in range(last // 2):  # blocks kb = 2 j + 1 (Y) and kb + 1 (X); block kb - 1 (X) is in flight
            kb = 2 * j + 1
            nx = _block_scale(a_sc, b_sc, gl.minimum(kb + 1, last), s_ask, s_bsk)
            ny = _block_scale(a_sc, b_sc, gl.minimum(kb + 2, last), s_ask, s_bsk)
            tok_y = _issue(a_smem, b_smem, ready, c, i0 + kb, py, STAGES, HALF)
            px = warpgroup_mma_wait(num_outstanding=1, deps=(tok_x,))  # block kb - 1 done, block kb runs
            _release(empty.index((i0 + kb - 1) % STAGES))  # both warpgroups' arrivals free the slot
            acc += px * sx[:, None]
            tok_x = _issue(a_smem, b_smem, ready, c, i0 + kb + 1, _free_after(px, acc), STAGES, HALF)
            py = warpgroup_mma_wait(num_outstanding=1, deps=(tok_y,))  # block kb done, block kb + 1 runs
            _release(empty.index((i0 + kb) % STAGES))
            acc += py * sy[:, None]
            py = _free_after(py, acc)
            sx = nx
            sy = ny
        if n_kb % 2 == 0:  # the last block is odd: Y
            tok_y = _issue(a_smem, b_smem, ready, c, i0 + last, py, STAGES, HALF)
            px = warpgroup_mma_wait(num_outstanding=1, deps=(tok_x,))
            _release(empty.index((i0 + last - 1) % STAGES))
            acc += px * sx[:, None]
            py = warpgroup_mma_wait(num_outstanding=0, deps=(tok_y,))
            _release(empty.index((i0 + last) % STAGES))
            acc += py * sy[:, None]
        else:
            px = warpgroup_mma_wait(num_outstanding=0, deps=(tok_x,))
            _release(empty.index((i0 + last) % STAGES))
            acc += px * sx[:, None]
        return acc

    @gluon.jit
    def _store_rows(c_ptr, acc, first_row, row_end, n0, N, s_cm, OUT_L: gl.constexpr):
        """acc [64, W] (fp32) into rows first_row .. (below row_end), columns n0 .. (below N), stored in OUT_L."""
        out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), OUT_L)
        o_rows = first_row + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, OUT_L))
        o_cols = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, OUT_L))
        ptrs = c_ptr + o_rows.to(gl.int64)[:, None] * s_cm + o_cols[None, :]
        gl.store(ptrs, out, mask=(o_rows < row_end)[:, None] & (o_cols < N)[None, :])

    @gluon.jit
    def _row_scales(a_scale_ptr, first_row, row_end, ACC_L: gl.constexpr):
        """Pointers to the activation scales of rows first_row .. + 63 in K block 0, clamped to the tile's last row
        (a row past the tile is computed, not stored)."""
        rows = first_row + gl.arange(0, _HM, layout=gl.SliceLayout(1, ACC_L))
        return a_scale_ptr + gl.minimum(rows, row_end - 1)

    @gluon.jit
    def _consumer(c, a_smem, b_smem, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, tile_expert_ptr, tile_row0_ptr,
                  tile_rowend_ptr, N, n_kb, tiles_m, tiles_n, s_ask, s_bse, s_bsn, s_bsk, s_cm,
                  E: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Warpgroup c's share of each of this program's tiles, in the producer's order: rows 64 c .. 64 c + 63 of
        an expert's tile; in a tile of at most 64 rows (an expert's ragged last tile: one A box) those rows times
        columns 64 c .. 64 c + 63, so both warpgroups share its MMAs and the tile costs half; zeros for a tile of
        group E."""
        i = gl.program_id(0) * 0  # ring position, as the producer counts it
        for slot in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            tile, pid_n = _swizzled_tile(slot, tiles_m, tiles_n, GROUP_M)
            e = gl.load(tile_expert_ptr + tile)
            if e <= E:
                row0 = gl.load(tile_row0_ptr + tile)
                row_end = gl.load(tile_rowend_ptr + tile)
                n0 = pid_n * _BN
                if e == E:  # the rows past offsets[-1]: zeros, no K blocks
                    zeros = gl.zeros([_HM, _BN], gl.float32, _ACC_L)
                    _store_rows(c_ptr, zeros, row0 + c * _HM, row_end, n0, N, s_cm, _OUT_L)
                else:
                    b_sc = b_scale_ptr + e.to(gl.int64) * s_bse + pid_n * s_bsn  # BLOCK_N: one weight-scale block
                    if row_end - row0 <= _HM:
                        # (names apart from the other branch's: an if's branches must agree on a name's layout)
                        half_sc = _row_scales(a_scale_ptr, row0, row_end, _ACC_H)
                        half = _tile_product(c, a_smem, b_smem, ready, empty, half_sc, b_sc, i, n_kb, s_ask, s_bsk,
                                             STAGES, True, _HN, _ACC_H)  # fmt: skip
                        _store_rows(c_ptr, half, row0, row_end, n0 + c * _HN, N, s_cm, _OUT_H)
                    else:
                        a_sc = _row_scales(a_scale_ptr, row0 + c * _HM, row_end, _ACC_L)
                        acc = _tile_product(c, a_smem, b_smem, ready, empty, a_sc, b_sc, i, n_kb, s_ask, s_bsk,
                                            STAGES, False, _BN, _ACC_L)  # fmt: skip
                        _store_rows(c_ptr, acc, row0 + c * _HM, row_end, n0, N, s_cm, _OUT_L)
                    i += n_kb

    @gluon.jit
    def _fp8_grouped_gluon_kernel(
        a_desc, b_desc, a_scale_ptr, b_scale_ptr, c_ptr, tile_expert_ptr, tile_row0_ptr, tile_rowend_ptr,
        N, K, tiles_m, s_ask, s_bse, s_bsn, s_bsk, s_cm,
        E: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):  # fmt: skip
        """A persistent program: output tiles slot = program_id, + num_programs, ... of the tiles_m x
        ceil(N / 128) tile slots (one 128 x 128 tile of expert e each; zeros for a tile of group E, the rows past
        the last expert; nothing for a slot past the last tile, group E + 1)."""
        tiles_n = gl.cdiv(N, _BN)
        n_kb = gl.cdiv(K, _BK)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, _HM, _BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _BN, _BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        _sync()
        # (argument tuples written out: a tuple bound to a name first turns its constexprs into tensors)
        gl.warp_specialize(
            [
                (_consumer, (0, a_smem, b_smem, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, tile_expert_ptr,
                             tile_row0_ptr, tile_rowend_ptr, N, n_kb, tiles_m, tiles_n, s_ask, s_bse, s_bsn, s_bsk,
                             s_cm, E, GROUP_M, STAGES)),
                (_consumer, (1, a_smem, b_smem, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, tile_expert_ptr,
                             tile_row0_ptr, tile_rowend_ptr, N, n_kb, tiles_m, tiles_n, s_ask, s_bse, s_bsn, s_bsk,
                             s_cm, E, GROUP_M, STAGES)),
                (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, tile_row0_ptr,
                             tile_rowend_ptr, N, n_kb, tiles_m, tiles_n, E, GROUP_M, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_weight_reason(device: torch.device, w8: torch.Tensor) -> str | None:
    """None if `fp8_grouped_mm_gluon` runs on `device` with weights w8 [E, N, K] (whatever the activations, as
    `triton_act_quant` lays them out), else why not. The dispatch asks this before quantizing anything."""
    if device.type != "cuda":
        return f"device {device.type} (the Gluon FP8 kernel runs on CUDA sm_90 only)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"compute capability {major}.{minor} (wgmma, TMA and setmaxnreg as written need sm_90)"
    if TMA_ERROR is not None:
        return TMA_ERROR
    if (reason := gluon_reason()) is not None:
        return reason
    K = w8.shape[-1]
    if K % 16:
        return f"K {K} is not a multiple of 16 (TMA needs 16-byte row pitches; the Triton kernel takes it)"
    if w8.dtype != FP8 or w8.dim() != 3:
        return f"w8 must be float8_e4m3fn [E, N, K]; got {w8.dtype} {tuple(w8.shape)}"
    if not w8.is_contiguous() or w8.data_ptr() % 16:
        return "w8 must be contiguous and 16-byte aligned (TMA reads it as [E * N, K])"
    return None


def gluon_support_reason(x8: torch.Tensor, w8: torch.Tensor) -> str | None:
    """None if `fp8_grouped_mm_gluon` runs x8 [M_pad, K] times w8 [E, N, K] here, else why not (no GPU needed to
    ask: CPU tensors and faked capabilities are answered too)."""
    if (reason := gluon_weight_reason(x8.device, w8)) is not None:
        return reason
    if x8.dtype != FP8:
        return f"x8 must be float8_e4m3fn, got {x8.dtype}"
    if x8.dim() != 2 or x8.stride(1) != 1 or x8.stride(0) % 16 or x8.data_ptr() % 16:
        return "x8 must be [M_pad, K] with a unit K stride, 16-byte aligned rows and base (TMA)"
    return None


def fp8_grouped_mm_gluon(
    x8: torch.Tensor,
    x_scale_t: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    M: int,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """`triton_fp8_grouped.fp8_grouped_mm_triton`'s contract: the first M rows of x8 [M_pad, K] (sorted by expert;
    scales x_scale_t [ceil(K / 128), M_pad], unit stride along M) times their experts' w8 [E, N, K]^T (scales
    w_scale [E, ceil(N / 128), ceil(K / 128)]); offsets int32 [E] cumulative row ends -> [M, N] in out_dtype, rows
    past offsets[-1] zero. config: knobs of `GLUON_CFG`. Raises ValueError with `gluon_support_reason`'s answer when
    it refuses the inputs (the Triton kernel takes every shape)."""
    c = kernel_config(GLUON_CFG, config, "fp8 grouped Gluon GEMM")
    if c["STAGES"] < 2:  # a consumer holds two slots (the block it promotes and the one in flight)
        raise ValueError(f"fp8_grouped_mm_gluon: STAGES must be at least 2, got {c['STAGES']}")
    if (reason := gluon_support_reason(x8, w8)) is not None:
        raise ValueError(f"fp8_grouped_mm_gluon: {reason}")
    E, N, K = w8.shape
    out = torch.empty(M, N, device=x8.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:  # no K blocks: all zeros (the consumers' K loop starts with a block)
        return out.zero_()
    assert x_scale_t.stride(1) == 1, "x_scale_t needs a unit stride along M"
    from triton.experimental.gluon import language as gl

    from ..moe.triton_grouped import tile_table  # here: dsaflow.ops.moe imports this package

    ends = torch.cat([offsets.to(torch.int32), offsets.new_full((1,), M, dtype=torch.int32)])
    expert, row0, row_end = tile_table(ends, M, BLOCK_M)
    a_layout = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(x8, [HALF_M, BLOCK], a_layout)
    b_desc = TensorDescriptor.from_tensor(w8.view(E * N, K), [BLOCK_N, BLOCK], b_layout)
    slots = expert.numel() * triton.cdiv(N, BLOCK_N)
    persistent = K <= c["PERSISTENT_MAX_K"]
    grid = (min(slots, _sm_count(x8.device)) if persistent else slots,)  # each program walks its slots
    _fp8_grouped_gluon_kernel[grid](
        a_desc, b_desc, x_scale_t, w_scale, out, expert, row0, row_end, N, K, expert.numel(),
        x_scale_t.stride(0), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0),
        E=E, GROUP_M=c["GROUP_M"], STAGES=c["STAGES"], CONSUMER_REGS=c["CONSUMER_REGS"],
        PRODUCER_REGS=c["PRODUCER_REGS"], num_warps=4,
    )  # fmt: skip
    return out
