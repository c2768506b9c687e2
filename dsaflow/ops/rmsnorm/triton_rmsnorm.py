"""Triton RMSNorm forward and backward (fp32 math, x.dtype out), the contract of `naive.rms_norm_naive`.

Forward: one program normalises BLOCK_R rows and keeps 1 / rms per row (fp32) for the backward. Backward: each
program walks a fixed block of rows, writes dx and keeps its own fp32 partial sum of dy * x_hat for the weight; one
torch.sum over programs finishes dweight, so the result does not depend on scheduling (deterministic). The program
count depends on the shape only. Rows are read through their stride (the kv latent is a strided slice).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_empty = torch.empty  # every output buffer comes from here (the tests poison it with NaN)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DIM = 16384  # one program holds whole rows
MAX_PROGRAMS = 512  # backward: ~4 waves on a 132-SM GPU; the weight-gradient partials are [programs, D] fp32


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, R, D, s_x, s_y, eps,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rm, dm = r < R, d < D
    m = rm[:, None] & dm[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * s_x + d[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + r64[:, None] * s_y + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + r, rstd, mask=rm)


@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, R, D, rows_per_prog,
                    s_x, s_dy, s_dx, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # dx = rstd * (w dy - x_hat * mean(x_hat * w dy)),  dw = sum over rows of dy * x_hat   (x_hat = x * rstd)
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    row0 = pid * rows_per_prog
    for start in range(0, rows_per_prog, BLOCK_R):
        r = row0 + start + tl.arange(0, BLOCK_R)
        rm = r < R
        m = rm[:, None] & dm[None, :]
        r64 = r.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * s_x + d[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64[:, None] * s_dy + d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=rm, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(x_hat * wdy, axis=1) / D
        dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + r64[:, None] * s_dx + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + d, dw, mask=dm)


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None if the kernels take these inputs, else why not."""
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return f"dtypes x={x.dtype} weight={weight.dtype} (bf16/fp16/fp32)"
    if x.dim() == 0 or weight.shape != x.shape[-1:]:
        return f"x {tuple(x.shape)} with weight {tuple(weight.shape)} (weight [D] for x [..., D])"
    if x.shape[-1] > MAX_DIM:
        return f"D={x.shape[-1]} > {MAX_DIM} (one program holds a whole row)"
    return None


def _config(D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): ~4K elements a program for narrow rows, one row of up to 16K otherwise."""
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 4096 // block_d))
    # ~16 fp32 elements of a tile per thread: the backward holds x, dy, w and the dw partial of a whole row.
    warps = max(1, min(16, block_d * block_r // 512))
    return block_r, block_d, warps


def _rows(a: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [rows, D] with a contiguous last dim, as a view where the strides allow it."""
    a = a.reshape(-1, a.shape[-1])
    return a if a.stride(-1) == 1 or a.shape[0] == 0 else a.contiguous()


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D], weight [D] -> (y [..., D] in x.dtype, rstd [rows] fp32)."""
    x2 = _rows(x)
    R, D = x2.shape
    y = _empty((R, D), device=x.device, dtype=x.dtype)
    rstd = _empty(R, device=x.device, dtype=torch.float32)
    if R:
        block_r, block_d, warps = _config(D)
        _rms_fwd_kernel[(triton.cdiv(R, block_r),)](x2, weight, y, rstd, R, D, x2.stride(0), y.stride(0), float(eps),
                                                    BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    return y.view(x.shape), rstd


def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                 max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dx [..., D] in x.dtype, dweight [D] in weight.dtype). Deterministic."""
    x2, dy2 = _rows(x), _rows(dy)
    R, D = x2.shape
    dx = _empty((R, D), device=x.device, dtype=x.dtype)
    block_r, block_d, warps = _config(D)
    n_prog = max(1, min(triton.cdiv(R, block_r), max_programs))
    rows_per_prog = triton.cdiv(triton.cdiv(R, n_prog), block_r) * block_r
    n_prog = max(1, triton.cdiv(R, rows_per_prog))
    part = _empty((n_prog, D), device=x.device, dtype=torch.float32)
    if R:
        _rms_bwd_kernel[(n_prog,)](x2, weight, dy2, rstd, dx, part, R, D, rows_per_prog, x2.stride(0), dy2.stride(0),
                                   dx.stride(0), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    else:
        part.zero_()
    return dx.view(x.shape), part.sum(0).to(weight.dtype)
