"""torch's own DeepSeek-style block-scaled GEMM: `torch.nn.functional.scaled_mm` (torch 2.10+) with BlockWise1x128
activation scales and BlockWise128x128 weight scales, which torch runs through cuBLASLt on sm_90 only (CUDA 12.9+).

Its scale layouts (torch's `_scaled_block1x128_block128x128` checks them; `test_scaled_matmul_cuda.py` upstream
builds them the same way), for A [M, K] row-major and B = w8.t() [K, N] column-major:
  A scale [M, ceil(K / 128)], strides (1, M): outer-dim-major, which `quantize_rows_1x128_triton`'s K-block-major
    scale_t is once transposed. M is padded to a multiple of 4 (16-byte scale columns for cuBLASLt, as vLLM does).
  B scale [L4, ceil(N / 128)], strides (1, L4), L4 = ceil(K / 128) rounded up to a multiple of 4: the checkpoint's
    [ceil(N / 128), ceil(K / 128)] transposed, with its K blocks padded to L4 where they are not already (a
    [ceil(N / 128), L4] copy per call; DeepSeek-V3.2's K of 512, 1536, 2048, 7168 and 16384 need none).
torch's older `_scaled_mm` takes these scales unpadded, which cuBLASLt read wrongly where ceil(K / 128) % 4 != 0
(pytorch#166752), so only `scaled_mm` is used here. torch's grouped form (`scaled_grouped_mm`) takes rowwise FP8 and
MXFP8 scales but no 1x128 / 128x128 blocks, so the grouped GEMM has no torch row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import blocks

SCALED_MM_PAD_ROWS = 4


def _recipe(scaling_type, *names):
    """The first of `names` that torch's ScalingType enum has (the member names moved between releases)."""
    return next((getattr(scaling_type, n) for n in names if hasattr(scaling_type, n)), None)


def block_recipes():
    """(BlockWise1x128, BlockWise128x128) from torch.nn.functional.ScalingType, or None where this torch lacks
    them."""
    scaling_type = getattr(F, "ScalingType", None)
    if scaling_type is None or not hasattr(F, "scaled_mm"):
        return None
    rows = _recipe(scaling_type, "BlockWise1x128", "Blockwise_1x128")
    squares = _recipe(scaling_type, "BlockWise128x128", "Blockwise_128x128")
    return (rows, squares) if rows is not None and squares is not None else None


def torch_support_reason() -> str | None:
    """None where this torch build has the block-scaled `scaled_mm` (read from its version and attributes only;
    nothing runs), else why not."""
    if block_recipes() is None:
        return (
            f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 "
            "scaling (torch 2.10+)"
        )
    cuda = torch.version.cuda
    if not cuda:
        return f"torch {torch.__version__} is not a CUDA build (cuBLASLt runs the block-scaled GEMM)"
    if tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return f"block-scaled cuBLASLt GEMMs need CUDA 12.9+; this torch is built with CUDA {cuda}"
    return None


def fp8_linear_torch(
    x8: torch.Tensor, x_scale_t: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, M: int
) -> torch.Tensor:
    """x8 [M_pad, K] (M_pad a multiple of 4; scales x_scale_t [ceil(K / 128), M_pad], contiguous) times w8 [N, K]^T
    (contiguous; scales w_scale [ceil(N / 128), ceil(K / 128)]) -> bf16 [M, N], the first M rows."""
    rows_recipe, squares_recipe = block_recipes()
    KB = blocks(w8.shape[1])
    l4 = -(-KB // 4) * 4
    if l4 != KB or not w_scale.is_contiguous():
        w_scale = F.pad(w_scale, (0, l4 - KB))  # a contiguous [ceil(N / 128), L4] copy, zero-padded
    out = F.scaled_mm(x8, w8.t(), x_scale_t.t(), rows_recipe, w_scale.t(), squares_recipe, output_dtype=torch.bfloat16)
    return out[:M]
