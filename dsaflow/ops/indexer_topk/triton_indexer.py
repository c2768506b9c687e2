"""Triton lightning-indexer logits + exact causal top-k, chunked over queries so a 128K context stays bounded.

Logits I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s]) for a tile of BLOCK_T queries x BLOCK_S keys per program:
the key tile [BLOCK_S, D] is loaded once and reused by all H_I heads; per head one dot [BLOCK_T, D] x [D, BLOCK_S]
(bf16 in, fp32 accumulate), relu, times w, summed elementwise into an fp32 tile (no cross-thread reduction). A
single query per row (T == 1, a decode step) runs `_indexer_logits_one_query_kernel` instead: the heads are the rows
of one dot [H_I, D] x [D, BLOCK_S], relu, times w, summed over the heads (a reduction across the tile's rows). Key
tiles past the largest visible position of the query tile skip the dots and only write -inf (causal skip), or write
nothing at all for the top-k, whose radix select reads only each row's visible prefix. The grid is one axis (key
tile fastest, then query tile, then batch), so B * T and the context length are bounded only by 2^31 programs.

Top-k (`indexer_topk_triton`): fp32 logits, then `triton_select.radix_topk_triton` (an exact select, not a sort of
the row: sampled floor, one streaming compaction, a radix select on the candidate keys, the survivors written in
the candidates' ascending key order; ties to the lower key index, -1 padding, exactly `naive.topk_from_scores`).
Chunk size, grids and buffers depend on shapes only, so the whole op is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .budget import query_chunk
from .fp8 import fp8_reason
from .triton_select import radix_topk_triton, select_scratch


@triton.jit
def _indexer_logits_kernel(
    q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr, kscale_ptr,
    T, S, H, D,
    s_qb, s_qt, s_qh,
    s_kb, s_ks, s_ksb, s_kss,
    s_wb, s_wt, s_wh,
    s_pb, s_pt,
    s_ob, s_ot,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_INVISIBLE: tl.constexpr, DOT_PREC: tl.constexpr, K_SCALED: tl.constexpr,
):
    # one grid axis (axes 1-2 stop at 65,535): key tile fastest, so neighbouring programs share the query tile
    pid = tl.program_id(0).to(tl.int64)
    n_s = tl.cdiv(S, BLOCK_S)
    n_t = tl.cdiv(T, BLOCK_T)
    pid_s = pid % n_s
    pid_t = (pid // n_s) % n_t
    b = pid // (n_s * n_t)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    pos = tl.load(pos_ptr + b * s_pb + offs_t * s_pt, mask=t_ok, other=-1)
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    any_visible = pid_s * BLOCK_S <= tl.max(pos, 0)
    if any_visible:  # some key of this tile is visible to some query of the tile
        k = tl.load(k_ptr + b * s_kb + offs_s[:, None] * s_ks + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        k_t = tl.trans(k.to(q_ptr.dtype.element_ty))  # e4m3 keys of an FP8 cache meet bf16 queries exactly
        q_rows = q_ptr + b * s_qb + offs_t[:, None] * s_qt + offs_d[None, :]
        w_rows = w_ptr + b * s_wb + offs_t * s_wt
        for h in range(H):
            qh = tl.load(q_rows + h * s_qh, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            wh = tl.load(w_rows + h * s_wh, mask=t_ok, other=0.0).to(tl.float32)
            acc += tl.maximum(tl.dot(qh, k_t, input_precision=DOT_PREC), 0.0) * wh[:, None]
        if K_SCALED:  # fp8 keys: relu(s_k x) = s_k relu(x) for the positive per-key scale, so it applies once here
            acc = acc * tl.load(kscale_ptr + b * s_ksb + offs_s * s_kss, mask=s_ok, other=0.0)[None, :]
    visible = (offs_s[None, :] <= pos[:, None]) & s_ok[None, :]
    acc = tl.where(visible, acc, float("-inf"))
    offs_t = offs_t.to(tl.int64)  # rows x S can pass 2^31 elements
    if not WRITE_INVISIBLE:
        t_ok = t_ok & (offs_t * 0 + pid_s * BLOCK_S <= tl.max(pos, 0))  # a tensor, not a scalar, for the mask
    tl.store(out_ptr + b * s_ob + offs_t[:, None] * s_ot + offs_s[None, :], acc, mask=t_ok[:, None] & s_ok[None, :])


@triton.jit
def _indexer_logits_one_query_kernel(
    q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr, kscale_ptr, key_rows_ptr,
    S, H, D,
    s_qb, s_qh,
    s_kb, s_ks, s_ksb, s_kss,
    s_wb, s_wh,
    s_pb,
    s_ob,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_INVISIBLE: tl.constexpr, DOT_PREC: tl.constexpr, K_SCALED: tl.constexpr, KEY_ROWS: tl.constexpr,
):
    # T == 1 (a decode step): the heads are the rows of one dot [BLOCK_H, D] x [D, BLOCK_S], then relu, times w and
    # a sum over heads; the per-head loop of the tiled kernel would serialise H short dots behind their loads.
    # KEY_ROWS: query b scores the keys of row key_rows[b] (a token-major serving pass, one query per b)
    pid = tl.program_id(0).to(tl.int64)
    n_s = tl.cdiv(S, BLOCK_S)
    pid_s = pid % n_s
    b = pid // n_s
    kb = b
    if KEY_ROWS:
        kb = tl.load(key_rows_ptr + b).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    pos = tl.load(pos_ptr + b * s_pb)
    tile_visible = pid_s * BLOCK_S <= pos
    acc = tl.zeros([BLOCK_S], tl.float32)
    if tile_visible:
        q = tl.load(q_ptr + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + b * s_wb + offs_h * s_wh, mask=h_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + kb * s_kb + offs_s[:, None] * s_ks + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        logits = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty)), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_S]
        acc = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
        if K_SCALED:
            acc = acc * tl.load(kscale_ptr + kb * s_ksb + offs_s * s_kss, mask=s_ok, other=0.0)
    acc = tl.where((offs_s <= pos) & s_ok, acc, float("-inf"))
    store_ok = s_ok if WRITE_INVISIBLE else s_ok & (offs_s * 0 + pid_s * BLOCK_S <= pos)
    tl.store(out_ptr + b * s_ob + offs_s, acc, mask=store_ok)


@triton.jit
def _quantize_rows_kernel(x_ptr, x8_ptr, scale_ptr, w_ptr, w_out_ptr, n_rows, D,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    """Rows of D values -> e4m3 rows and fp32 scales amax * (1 / 448) (the values divided by the scale with IEEE
    division, rounded to nearest even: `fp8.quantize_rows`); with HAS_W also w * scale, one weight per row (the
    queries' scales folded into w)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    m = r_ok[:, None] & (offs_d[None, :] < D)
    x = tl.load(x_ptr + rows[:, None] * D + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)  # fp8.E4M3_MAX, times its fp32 reciprocal as there
    x8 = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)).to(tl.float8e4nv)
    tl.store(x8_ptr + rows[:, None] * D + offs_d[None, :], x8, mask=m)
    tl.store(scale_ptr + rows, scale, mask=r_ok)
    if HAS_W:
        wv = tl.load(w_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(w_out_ptr + rows, wv * scale, mask=r_ok)


def fp8_key_views(k: torch.Tensor, d: int):
    """A packed FP8 key cache uint8 [R, S, d + 4] (serve.kv_dtype=fp8, dsaflow.ops.kv_fp8) -> its e4m3 keys [R, S, d]
    and fp32 scales [R, S], views of the cache."""
    from dsaflow.ops.kv_fp8 import fp8_format_of, fp8_row_views

    fmt = fp8_format_of(k, d, 0)
    if fmt is None or fmt.blocks != 1:
        raise ValueError(f"indexer_topk: a uint8 k of {k.shape[-1]} bytes per key is no FP8 key cache of {d} dims")
    keys, scales, _ = fp8_row_views(k, fmt)
    return keys, scales[..., 0]


def quantize_rows_triton(x: torch.Tensor, w: torch.Tensor | None = None):
    """CUDA `fp8.quantize_rows` in one pass: x [..., D] -> (x8 float8_e4m3fn [..., D], scale fp32 [...]), and with
    w [...] (same leading shape) also w * scale in fp32: (x8, scale, w_scaled)."""
    D = x.shape[-1]
    lead = x.shape[:-1]
    xr = x.reshape(-1, D)
    if xr.stride(-1) != 1 or xr.stride(0) != D:
        xr = xr.contiguous()
    n = xr.shape[0]
    x8 = torch.empty(lead + (D,), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(lead, device=x.device, dtype=torch.float32)
    w_flat = w.reshape(-1).contiguous() if w is not None else scale
    w_out = torch.empty(lead, device=x.device, dtype=torch.float32) if w is not None else scale
    if w is not None and w_flat.numel() != n:
        raise ValueError(f"quantize_rows_triton: w {tuple(w.shape)} needs one weight per row of x {tuple(x.shape)}")
    block_d = max(16, triton.next_power_of_2(D))
    block_r = max(1, min(64, 8192 // block_d))
    if n:
        _quantize_rows_kernel[(triton.cdiv(n, block_r),)](xr, x8, scale, w_flat, w_out, n, D, BLOCK_R=block_r,
                                                          BLOCK_D=block_d, HAS_W=w is not None, num_warps=4)
    return (x8, scale, w_out) if w is not None else (x8, scale)


def logits_config(T: int, S: int, D: int, overrides: dict | None = None) -> dict:
    cfg = dict(
        BLOCK_T=min(64, max(16, triton.next_power_of_2(T))),
        BLOCK_S=min(128, max(16, triton.next_power_of_2(S))),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=4,
        num_stages=3,
    )
    cfg.update(overrides or {})
    return cfg


def indexer_logits_triton(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None,
    overrides: dict | None = None, write_invisible: bool = True, k_scale: torch.Tensor | None = None,
    key_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, H, D], k [B, S, D], w [B, T, H], positions [B, T] -> logits [B, T, S] fp32, -inf where invisible.

    key_rows int [B] (T == 1 only): query b scores the keys k[key_rows[b]] of a k [R, S, D] with any R (a
    token-major serving pass); k_scale is then [R, S].

    fp8 k (float8_e4m3fn, `fp8.quantize_rows`, or an FP8 cache's keys) needs k_scale [B, S] fp32 (any strides), the
    keys' scales; q is fp8 too (its scales folded into w by the caller: w[b, t, h] * q_scale[b, t, h]) or bf16/fp32,
    which the e4m3 keys are converted to exactly.

    `out` may be a preallocated fp32 [B, T, S] buffer with a contiguous last dim (reused across chunks).
    write_invisible=False leaves key tiles that no query of the tile can see unwritten (the radix select reads only
    each row's visible prefix): half the writes of a prefill."""
    B, T, H, D = q.shape
    S = k.shape[1]
    if out is None:
        out = torch.empty(B, T, S, device=q.device, dtype=torch.float32)
    cfg = logits_config(T, S, D, overrides)
    if q.dtype == torch.float8_e4m3fn:  # fp8 tensor-core dots take K in steps of 32
        cfg["BLOCK_D"] = max(32, cfg["BLOCK_D"])
    grid = (triton.cdiv(S, cfg["BLOCK_S"]) * triton.cdiv(T, cfg["BLOCK_T"]) * B,)
    if grid[0] >= 2**31:
        raise ValueError(f"indexer logits: {grid[0]} programs for B={B} T={T} S={S} exceed the grid limit")
    fp8 = torch.float8_e4m3fn
    if (k.dtype == fp8) != (k_scale is not None) or (q.dtype == fp8 and k.dtype != fp8):
        raise ValueError(f"indexer logits: q {q.dtype} / k {k.dtype} with k_scale "
                         f"{'given' if k_scale is not None else 'missing'}: fp8 keys need k_scale [B, S], and fp8 "
                         "queries fp8 keys")
    ks = k_scale if k_scale is not None else w  # any tensor: K_SCALED=False never reads it
    # fp32 inputs mean fp32 scores (IEEE, not TF32): rounded scores can reorder near-ties and change the top-k
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if key_rows is not None and (T != 1 or overrides):
        raise ValueError(f"indexer logits: key_rows needs one query per batch row and the one-query kernel, got T={T} "
                         f"and overrides={overrides}")
    if T == 1 and not overrides:  # a decode step: heads as the rows of one dot
        block_s = 128
        rows = key_rows if key_rows is not None else positions  # any tensor: KEY_ROWS=False never reads it
        _indexer_logits_one_query_kernel[(triton.cdiv(S, block_s) * B,)](
            q, k, w, positions, out, ks, rows,
            S, H, D,
            q.stride(0), q.stride(2),
            k.stride(0), k.stride(1), ks.stride(0), ks.stride(1),
            w.stride(0), w.stride(2),
            positions.stride(0),
            out.stride(0),
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_S=block_s, BLOCK_D=cfg["BLOCK_D"],
            WRITE_INVISIBLE=write_invisible, DOT_PREC=prec,
            K_SCALED=k_scale is not None, KEY_ROWS=key_rows is not None, num_warps=4, num_stages=2,
        )
        return out
    _indexer_logits_kernel[grid](
        q, k, w, positions, out, ks,
        T, S, H, D,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), ks.stride(0), ks.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_S=cfg["BLOCK_S"], BLOCK_D=cfg["BLOCK_D"],
        WRITE_INVISIBLE=write_invisible, DOT_PREC=prec, K_SCALED=k_scale is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


@torch.no_grad()
def indexer_topk_triton(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, topk: int,
    chunk: int | None = None, overrides: dict | None = None, select_overrides: dict | None = None, fp8: bool = False,
    key_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `dsaflow.ops.indexer_topk.indexer_topk`: q [B, T, H_I, D_I], k [B, S, D_I], w [B, T, H_I],
    positions [B, T] int -> int32 [B, T, topk]: the best keys in ascending key order, -1 after them where fewer
    than topk keys are visible. fp32 logits (invisible tiles unwritten), then the select kernels (`triton_select`).
    CPU tensors run in the Triton interpreter. overrides: logits kernel config; select_overrides: radix select
    config (`triton_select.select_config`).
    fp8=True: q and k rounded to per-row-scaled fp8 e4m3 (`fp8.quantize_rows`) and multiplied on fp8 tensor cores,
    the queries' scales folded into w and the keys' applied after the head sum (compute capability 8.9+, else
    ValueError).
    key_rows int [B, T]: query (b, t) scores the keys of row key_rows[b, t] of a k [R, S, D_I] (`_topk_key_rows`)."""
    if fp8 and (reason := fp8_reason(q)) is not None:
        raise ValueError(f"indexer_topk: {reason}")
    k_scale = None
    if k.dtype == torch.uint8:  # a packed FP8 key cache: its e4m3 keys and scales, read in place
        k, k_scale = fp8_key_views(k, q.shape[-1])
    if fp8:
        q, _, w = quantize_rows_triton(q, w)  # the queries' scales folded into w
        if k_scale is None:
            k, k_scale = quantize_rows_triton(k)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    B, T = q.shape[:2]
    S = k.shape[1]
    out = torch.empty(B, T, topk, device=q.device, dtype=torch.int32)
    if S == 0 or T == 0:
        return out.fill_(-1)
    if key_rows is not None:
        return _topk_key_rows(q, k, w, positions, topk, key_rows, out, k_scale, chunk, select_overrides)
    chunk = chunk or query_chunk(B, T, S)
    rows = min(chunk, T)
    scores = torch.empty(B, rows, S, device=q.device, dtype=torch.float32)
    scratch = select_scratch(B * rows, S, q.device, (select_overrides or {}).get("programs"))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        qc, wc, pc = q[:, t0:t1], w[:, t0:t1], positions[:, t0:t1]
        buf = scores[:, : t1 - t0]
        indexer_logits_triton(qc, k, wc, pc, buf, overrides, write_invisible=False, k_scale=k_scale)
        radix_topk_triton(buf, pc, topk, out=out[:, t0:t1], scratch=scratch, overrides=select_overrides)
    return out


def _topk_key_rows(q, k, w, positions, topk, key_rows, out, k_scale, chunk, select_overrides) -> torch.Tensor:
    """`indexer_topk_triton` with per-query key rows: every query becomes a batch row of its own ([B * T, 1]) and
    runs the one-query logits kernel against its key row, in chunks of queries under the score budget. Its cost: a
    prefill query reads its key tiles alone (the tiled kernel shares them across 64 queries of one row), so long
    chunks of a token-major pass pay more key reads than the [rows, T] layout (docs/serving.md, "Mixed passes")."""
    B, T, H, D = q.shape
    S, n = k.shape[1], B * T
    q1, w1 = q.reshape(n, 1, H, D), w.reshape(n, 1, H)
    p1, r1, o1 = positions.reshape(n, 1), key_rows.reshape(n), out.view(n, 1, topk)
    step = min(n, chunk or query_chunk(1, n, S))
    scores = torch.empty(step, 1, S, device=q.device, dtype=torch.float32)
    scratch = select_scratch(step, S, q.device, (select_overrides or {}).get("programs"))
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        buf = scores[: b1 - b0]
        indexer_logits_triton(q1[b0:b1], k, w1[b0:b1], p1[b0:b1], buf, None, write_invisible=False, k_scale=k_scale,
                              key_rows=r1[b0:b1])
        radix_topk_triton(buf, p1[b0:b1], topk, out=o1[b0:b1], scratch=scratch, overrides=select_overrides)
    return out
