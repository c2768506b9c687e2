"""Naive fp32 reference for MQA-mode sparse MLA attention.

Every head of query t attends to the same selected latent rows kv[b, indices[b, t, :]]. The first `d_v` columns of a
row are its value. An index of -1 or >= S selects nothing. A query with no valid key gets out = 0 and lse = -inf.
kv may be a packed FP8 cache (uint8 rows, serve.kv_dtype=fp8): the selected rows are dequantized in fp32
(`ops.kv_fp8.dequantize_fp8_rows`), the values the kernels compute with.
"""

from __future__ import annotations

import torch


def sparse_mla_naive(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D_qk], kv [B, S, D_qk], indices [B, T, K] int -> out [B, T, H, d_v] (q.dtype), lse [B, T, H] fp32.

    Differentiable in q and kv (autograd through indexing). lse is the natural-log sum of exp(scaled scores).
    """
    S = kv.shape[1]
    outs, lses = [], []
    for t0 in range(0, q.shape[1], chunk):
        qc, ic = q[:, t0 : t0 + chunk].float(), indices[:, t0 : t0 + chunk].long()
        valid = (ic >= 0) & (ic < S)  # [B, t, K]
        # Advanced indexing, not gather over an expanded kv: its backward accumulates into [B, S, D_qk] instead of
        # materialising a [B, t, S, D_qk] gradient (prohibitive at long context).
        batch = torch.arange(kv.shape[0], device=kv.device).view(-1, 1, 1)
        rows = _float_rows(kv, batch, ic.clamp(0, S - 1), d_v, q.shape[-1])  # [B, t, K, D_qk]
        # A missing key must contribute nothing even if the row it was clamped to holds garbage (an unwritten cache
        # row may be NaN): 0 * NaN would leak through the masked score and the value product.
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))
        scores = torch.einsum("bthd,btkd->bthk", qc, rows) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf when a row has no valid key
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        outs.append(torch.einsum("bthk,btkd->bthd", p, rows[..., :d_v]).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _float_rows(kv: torch.Tensor, batch: torch.Tensor, index: torch.Tensor, d_v: int, d_qk: int) -> torch.Tensor:
    """The rows kv[batch, index] in fp32; a packed FP8 cache's selected rows dequantized (never the whole cache)."""
    if kv.dtype != torch.uint8:
        return kv.float()[batch, index]
    from dsaflow.ops.kv_fp8 import dequantize_fp8_rows, fp8_format_of

    fmt = fp8_format_of(kv, d_v, d_qk - d_v)
    if fmt is None:
        raise ValueError(
            f"sparse_mla: a uint8 kv of {kv.shape[-1]} bytes per row is no FP8 cache of d_v={d_v}, d_qk={d_qk}"
        )
    return dequantize_fp8_rows(kv[batch, index], fmt)
