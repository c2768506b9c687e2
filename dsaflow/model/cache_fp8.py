"""The FP8 serving cache (`serve.kv_dtype=fp8`): its writes and reads, beside `cache.py`'s bf16 ones.

A layer's latent cache is one packed byte row per position, uint8 [max_batch, max_context + 1, nbytes]: kv_lora_rank
e4m3 values, one fp32 scale per 128 of them, the RoPE dims in bf16 (656 bytes at V3.2's dims); an F layer's indexer
keys likewise, index_head_dim e4m3 and one fp32 scale (132 bytes). Layout and rounding: dsaflow.config.
kv_cache_format and dsaflow.ops.kv_fp8. The buffers keep `cache.py`'s shape contract (rows on dim 0, positions on
dim 1, the trash row last; `StageCache.allocate(kv_dtype="fp8")` makes them), so row moves, resets, row views and
the flat token-major view apply unchanged; only a write differs (quantize, then scatter: `write_cache_rows`), and
the readers (`sparse_mla`, `indexer_topk`) take the packed rows as they are.
"""

from __future__ import annotations

import torch

from dsaflow.config.kv_cache_format import Fp8RowFormat
from dsaflow.ops.kv_fp8 import dequantize_fp8_rows, write_fp8_rows

from .cache import write_rows


def is_fp8_cache(buffer: torch.Tensor) -> bool:
    return buffer.dtype == torch.uint8


def write_cache_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: Fp8RowFormat):
    """`cache.write_rows` for either cache: rows [B, T, D] at `slots` [B, T, 1] into buffer [max_batch, S, ...];
    an FP8 buffer (uint8) gets them quantized in `fmt` (one fused kernel on CUDA). Returns buffer[:B], what the
    attention and the indexer read."""
    if is_fp8_cache(buffer):
        return write_fp8_rows(buffer, slots, rows, fmt)
    return write_rows(buffer, slots, rows)


def latent_rows_for_heads(kv: torch.Tensor, fmt: Fp8RowFormat, dtype: torch.dtype) -> torch.Tensor:
    """Cached latent rows [B, S, C + R] as values in `dtype` for the short-prefill path (dsaflow.model.dense_prefill),
    which up-projects every visible row per head: an FP8 cache's rows [0, S) of this pass dequantized (the same
    values the sparse kernels compute with), a bf16 cache's as they are."""
    return dequantize_fp8_rows(kv, fmt, dtype) if is_fp8_cache(kv) else kv
