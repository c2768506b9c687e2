"""What the Hopper (sm_90) Gluon kernels share: the Gluon import, the capability rule, and the row gather.

The kernels (`hopper_seesaw` forward, its producer `hopper_seesaw_gather`, `hopper_backward`) are written against
triton 3.6's Gluon (`triton.experimental.gluon`, `warp_specialize([(fn, args), ...], worker_warps, worker_regs)`).
Gluon does not run in the CPU interpreter and its API moves between triton releases, so each kernel module defines
its kernels only when `GLUON_ERROR` is None, and the capability rules below say, without a GPU, why a call cannot
run them.
"""
from __future__ import annotations

import functools

import torch
import triton

LOG2E = 1.4426950408889634
D_V_SUPPORTED = 512
D_TAIL_SUPPORTED = 64
BLOCK_H = 64

try:  # Gluon exists from triton 3.4; the kernels are written against 3.6 (every name they import must exist)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    GLUON_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed triton
    GLUON_ERROR = f"triton {triton.__version__} has no usable Gluon ({type(e).__name__}: {e})"


@functools.lru_cache(maxsize=1)
def gluon_reason() -> str | None:
    """None if this triton's Gluon is the one the kernels are written for, else why not."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    import inspect
    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[0] != "functions_and_args":  # 3.4/3.5 took (default_args, default_fn, worker_args, worker_fns, ...)
        return f"triton {triton.__version__}: Gluon warp_specialize has the pre-3.6 signature {params[:4]}"
    return None


def kernel_config(defaults: dict, cfg: dict | None, what: str) -> dict:
    """`defaults` with the knobs of cfg over them; an unknown knob raises ValueError naming it and the known ones."""
    unknown = set(cfg or {}) - set(defaults)
    if unknown:
        raise ValueError(f"{what}: unknown config keys {sorted(unknown)} (known: {sorted(defaults)})")
    return dict(defaults, **(cfg or {}))


def device_reason(q: torch.Tensor) -> str | None:
    """The Gluon kernels run on CUDA devices of compute capability 9.x."""
    if q.device.type != "cuda":
        return f"device {q.device.type} (the Gluon kernels run on CUDA sm_90 only)"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"compute capability {major}.{minor} (warp specialisation with setmaxnreg and wgmma need sm_90)"
    return None


def shape_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """The device-independent part of the capability rule (tested on CPU); heads in blocks of BLOCK_H."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        return f"ranks q={q.dim()} kv={kv.dim()} indices={indices.dim()} (want 4, 3, 3)"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (want bf16 or fp16, equal)"
    if d_v != D_V_SUPPORTED or q.shape[-1] != D_V_SUPPORTED + D_TAIL_SUPPORTED or kv.shape[-1] != q.shape[-1]:
        return f"d_v={d_v}, d_qk={q.shape[-1]}, kv d={kv.shape[-1]} (want d_v 512, d_qk 576: DeepSeek MLA)"
    if q.shape[2] % BLOCK_H != 0:
        return f"H={q.shape[2]} (want a multiple of {BLOCK_H}: one wgmma M tile per head block)"
    if indices.dtype != torch.int32:
        return f"indices dtype {indices.dtype} (want int32)"
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1:
        return "q, kv and indices need contiguous last dims"
    if any(st % 8 for st in (*q.stride()[:3], *kv.stride()[:2])):
        return "q and kv strides must be multiples of 8 elements (16-byte row starts for cp.async)"
    if kv.shape[1] == 0 or indices.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return "empty kv, indices or queries"
    return None


if GLUON_ERROR is None:

    @gluon.jit
    def issue_rows(smem, kv_base, idx, S, s_kvs, col0, offs_d, mask_cols):
        """cp.async the rows kv_base[idx] (columns col0 + offs_d) into one stage tile; invalid rows zero-filled."""
        ok = (idx >= 0) & (idx < S)
        rows = kv_base + gl.where(ok, idx, 0).to(gl.int64) * s_kvs + col0
        ptrs = gl.max_contiguous(gl.multiple_of(rows[:, None] + offs_d[None, :], [1, 16]), [1, 8])
        async_copy.async_copy_global_to_shared(smem, ptrs, mask=ok[:, None] & mask_cols[None, :])

    @gluon.jit
    def signal(bar):
        """Every thread of this warpgroup has done its part (stores, loads, MMA waits): one arrival on `bar`."""
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)
