"""The FP8 KV cache rows (`serve.kv_dtype=fp8`): quantize-and-write, and the typed views the reading kernels take.

Layout and rounding: dsaflow.config.kv_cache_format (bytes) and `naive.py` (the rounding, the reference). The
writers run here (`write_fp8_rows`: `naive.py` on CPU, `triton_write.py` on CUDA); the readers dequantize in their
own kernels: `sparse_mla` over a packed latent cache, `indexer_topk` over packed indexer keys.
"""

from __future__ import annotations

import torch

from dsaflow.config.kv_cache_format import Fp8RowFormat, index_key_format, latent_format

from ..kernel_table import chosen, describe
from .dispatch import explain_write_fp8_rows
from .naive import (
    dequantize_fp8_rows,
    fp8_format_of,
    fp8_row_views,
    quantize_fp8_rows,
    unpack_fp8_rows,
    write_fp8_rows_naive,
)


def write_fp8_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: Fp8RowFormat) -> torch.Tensor:
    """Quantize rows and write them at their cache slots.

    Args:
        buffer: uint8 [B', S, fmt.nbytes], the packed cache of one layer (B' >= B).
        slots: int64 [B, T, 1], the cache position each row goes to (`model.cache.cache_slots`).
        rows: [B, T, fmt.width + fmt.rope] float, the fresh latent rows or indexer keys.
        fmt: the row format (`latent_format(model)`, `index_key_format(model)`).

    Returns:
        buffer[:B]. Branchless, allocation-free on CUDA (CUDA-graph safe); bit-identical on CPU and CUDA.
    """
    kernel = chosen("write_fp8_rows", explain_write_fp8_rows(buffer, rows), describe(buffer=buffer, rows=rows))
    if kernel == "reference":
        return write_fp8_rows_naive(buffer, slots, rows, fmt)
    from .triton_write import write_fp8_rows_triton

    return write_fp8_rows_triton(buffer, slots, rows, fmt)


__all__ = [
    "Fp8RowFormat",
    "dequantize_fp8_rows",
    "explain_write_fp8_rows",
    "fp8_format_of",
    "fp8_row_views",
    "index_key_format",
    "latent_format",
    "quantize_fp8_rows",
    "unpack_fp8_rows",
    "write_fp8_rows",
]
