"""Sparse MLA decode: split-K (flash-decoding) over the selected rows, then a combine kernel.

Decode has few queries (B sequences x one or a few tokens), so one program per (head block, query) would leave most
of the 132 SMs idle. Each query's K selected rows are split into `num_splits` ranges, each handled by its own program
(the prefill kernel with a key range), writing a normalised partial output and lse in fp32; `_combine_kernel` merges
them with weights exp(lse_s - lse). num_splits is a function of the shapes only, so grids and buffers are fixed for a
captured CUDA graph; the kv argument can be a preallocated cache [B, S_max, D_qk] (rows past a sequence's length are
never read as long as its indices are -1 there).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_prefill import fwd_config, launch_sparse_mla_fwd


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, n_rows, D_V, num_splits,
    s_po_split, s_pl_split,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """part_out [NS, n_rows, D_V] fp32, part_lse [NS, n_rows] fp32 -> out [n_rows, D_V], lse [n_rows] fp32.

    A row is one (b, t, h). All partial tensors are contiguous over (b, t, h, d). Offsets are int64: n_rows * D_V
    and num_splits * s_po_split exceed 2^31 at 2^20 queries x 128 heads."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < n_rows
    offs_d = tl.arange(0, BLOCK_DV)
    ok = r_ok[:, None] & (offs_d < D_V)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    pl = part_lse_ptr + offs_r  # advanced by whole splits: 64-bit pointer steps, no int32 products
    for _s in range(num_splits):
        m = tl.maximum(m, tl.load(pl, mask=r_ok, other=float("-inf")))
        pl += s_pl_split
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    pl = part_lse_ptr + offs_r
    po = part_out_ptr + offs_r[:, None] * D_V + offs_d[None, :]
    for _s in range(num_splits):
        w = tl.exp(tl.load(pl, mask=r_ok, other=float("-inf")) - m_safe)
        acc += w[:, None] * tl.load(po, mask=ok, other=0.0)
        denom += w
        pl += s_pl_split
        po += s_po_split
    d_safe = tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + offs_r[:, None] * D_V + offs_d[None, :], (acc / d_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok)
    tl.store(lse_ptr + offs_r, tl.where(denom == 0.0, float("-inf"), m_safe + tl.log(d_safe)), mask=r_ok)


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(q: torch.Tensor, K: int, block_h: int, block_k: int) -> int:
    """Splits so the grid covers the SMs about once (a power of two), never below one row block per split.
    Shape-only. More splits cost fp32 partial outputs (ns x [B, T, H, d_v], large at H = 128) and a combine; the
    memory-bound small-H case gains from twice as many loads in flight (on an H200, 128 heads were fastest at the
    grid-filling split count and 16-head shards at twice it)."""
    B, T, H = q.shape[:3]
    n_sm = _num_sms(q.device.index or 0) if q.is_cuda else 132
    programs = B * T * triton.cdiv(H, block_h)
    want = triton.next_power_of_2(max(1, n_sm // programs))
    if H <= 32 and programs < n_sm:  # a grid that already covers the SMs gains nothing from a second split
        want *= 2
    return max(1, min(want, triton.cdiv(K, block_k), 64))


def decode_overrides(q: torch.Tensor, d_v: int) -> dict:
    """Decode-specific launch options on top of `fwd_config` (shape-only). Small-H shards (H <= 32: one 16-head
    block per program, memory-bound) in bf16/fp16 with a wide value (d_v >= 256) run on 8 warps instead of 4 (a
    few percent faster on an H200 for the TP-8 decode shard). Other shapes keep the prefill kernel's options."""
    if q.shape[2] <= 32 and q.element_size() == 2 and d_v >= 256:
        return {"num_warps": 8}
    return {}


def sparse_mla_decode_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
    num_splits: int | None = None, overrides: dict | None = None, use_extent: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward without autograd: q [B, T, H, D_qk], kv [B, S, D_qk] (a cache), indices [B, T, K] int32
    -> out [B, T, H, d_v] q.dtype, lse [B, T, H] fp32. Same contract as `sparse_mla`.
    use_extent (default: T > 1): bound each query's loop by its key extent. A serving prefill pass (T > 1) holds
    padding queries (no index) and short prompts, whose loops then stop at once; a decode step (T = 1) has full rows,
    where the extent kernel's extra launch would cost a large share of a ~0.1 ms call."""
    B, T, H, D_qk = q.shape
    K = indices.shape[2]
    overrides = {**decode_overrides(q, d_v), **(overrides or {})}
    cfg = fwd_config(q, d_v, D_qk - d_v, K, overrides)
    ns = num_splits or choose_num_splits(q, K, cfg["BLOCK_H"], cfg["BLOCK_K"])
    extent = T > 1 if use_extent is None else use_extent
    out = torch.empty(B, T, H, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    if ns == 1:
        launch_sparse_mla_fwd(q, kv, indices, sm_scale, d_v, out, lse, 1, overrides, use_extent=extent)
        return out, lse
    part_out = torch.empty(ns, B, T, H, d_v, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(ns, B, T, H, device=q.device, dtype=torch.float32)
    launch_sparse_mla_fwd(q, kv, indices, sm_scale, d_v, part_out, part_lse, ns, overrides, use_extent=extent)
    n_rows = B * T * H
    block_dv = max(16, triton.next_power_of_2(d_v))
    block_r = max(1, 4096 // block_dv)
    _combine_kernel[(triton.cdiv(n_rows, block_r),)](
        part_out, part_lse, out, lse, n_rows, d_v, ns, part_out.stride(0), part_lse.stride(0),
        BLOCK_R=block_r, BLOCK_DV=block_dv, num_warps=4,
    )
    return out, lse
