"""FP8 block-scaled GEMMs with DeepSeek-V3's recipe: activations quantized per 1x128 on the fly, weights stored per
128x128 block (e4m3 + fp32 `weight_scale_inv`), fp32 accumulation, output in the activations' dtype.

Layout: `naive.py` (the quantizers and the fp32 references), the kernels (`triton_act_quant.py`: the activations'
quantization; `triton_dequant.py`: a weight back to a plain matrix; `triton_fp8_gemm.py`, `triton_fp8_grouped.py`:
the GEMMs, launched from `tile_configs.py`'s tables; `torch_blockwise.py`: torch's cuBLASLt kernel;
`gluon_fp8_grouped.py`: a Gluon grouped GEMM for sm_90 that overlaps each K block's MMA with the previous block's
scaling, for many rows per expert), `dispatch.py` (the table and `explain_fp8_gemm`), `activation.py` (an input
quantized once for the GEMMs that share it: `Fp8Activation`) and the public functions below. Triton is imported
where a kernel runs, so importing these functions needs none. The weights are frozen (no gradient), so there is no autograd.Function. Nothing here syncs the host or shapes a
tensor by its values, so serving graphs capture both GEMMs.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .activation import Fp8Activation, quantize_activation, shared_fp8_input
from .dispatch import explain_fp8_gemm
from .naive import (
    BLOCK,
    FP8,
    blocks,
    dequantize_blocks_128,
    dequantize_rows_1x128,
    fp8_grouped_mm_naive,
    fp8_grouped_mm_quantized_naive,
    fp8_linear_naive,
    fp8_linear_quantized_naive,
    quantize_blocks_128,
    quantize_rows_1x128,
)
from .tile_configs import dense_config


def _check_weight(op: str, x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, dims: int) -> None:
    """ValueError unless w8 is float8_e4m3fn with `dims` dims, K = x's last dim, and w_scale is its fp32 block
    scales on x's device."""
    if w8.dim() != dims or w8.dtype != FP8:
        raise ValueError(f"{op}: w8 must be float8_e4m3fn with {dims} dims, got {w8.dtype} {tuple(w8.shape)}")
    N, K = w8.shape[-2:]
    if x.shape[-1] != K:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} is not w8's K {K}")
    want = (*w8.shape[:-2], blocks(N), blocks(K))
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(f"{op}: w_scale must be fp32 {want} (one per 128x128 block), got {w_scale.dtype} "
                         f"{tuple(w_scale.shape)}")  # fmt: skip
    if not x.is_floating_point() or x.dtype == FP8:
        raise ValueError(f"{op}: x must be a float tensor to quantize, got {x.dtype}")
    if len({x.device, w8.device, w_scale.device}) != 1:
        raise ValueError(f"{op}: x, w8 and w_scale must share a device, got {x.device}, {w8.device}, {w_scale.device}")


def _row_major(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] with a contiguous last dim (the quantizers and the fused launch read rows): itself, or a copy."""
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _unpack(op: str, x, ue8m0: bool | None) -> tuple[torch.Tensor, Fp8Activation | None, bool]:
    """(the activation tensor, its Fp8Activation or None, the scale format) of a GEMM's x: a tensor or an
    Fp8Activation. ValueError where an Fp8Activation is stale or its format is not the one asked for."""
    if not isinstance(x, Fp8Activation):
        return x, None, bool(ue8m0)
    x.check_current(op)
    if ue8m0 is not None and ue8m0 != x.ue8m0:
        raise ValueError(f"{op}: ue8m0={ue8m0} but the activation was quantized with ue8m0={x.ue8m0}")
    return x.source, x, x.ue8m0


def fp8_linear(
    x: torch.Tensor | Fp8Activation, w8: torch.Tensor, w_scale: torch.Tensor, ue8m0: bool | None = None
) -> torch.Tensor:
    """x times a block-quantized weight, transposed, as DeepSeek-V3's FP8 linear layers run.

    Args:
        x: [..., K] activations (bf16 in serving; fp16 and fp32 too), quantized to e4m3 per row per 128 columns
            on the fly (`quantize_rows_1x128`); or an `Fp8Activation` (`quantize_activation(x)`, shared with other
            GEMMs on x), whose e4m3 rows and scales are read as they are.
        w8: float8_e4m3fn [N, K] weight (`quantize_blocks_128`, or a checkpoint's `weight`).
        w_scale: fp32 [ceil(N / 128), ceil(K / 128)] block scales (a checkpoint's `weight_scale_inv`): the weight is
            w8.float() times its block's scale.
        ue8m0: round the activations' scales up to powers of two (DeepSeek-V3.2's `scale_fmt: ue8m0`). None: False
            for a tensor, the Fp8Activation's own format for one (another value is an error).

    Returns:
        [..., N] in x's dtype: the quantized x times the dequantized weight, transposed, accumulated in fp32;
        bit-equal for x and for `quantize_activation(x)`. Graph-safe on CUDA. The kernel is `dispatch.py`'s choice
        (`explain_fp8_gemm(x, w8)` says which and why); a call no kernel takes raises ValueError with each kernel's
        reason.
    """
    x, xq, ue8m0 = _unpack("fp8_linear", x, ue8m0)
    _check_weight("fp8_linear", x, w8, w_scale, dims=2)
    kernel = chosen("fp8_linear", explain_fp8_gemm(x, w8), describe(x=x, w8=w8))
    N, K = w8.shape
    if kernel == "reference":
        if xq is None:
            return fp8_linear_naive(x, w8, w_scale, ue8m0)
        x8, x_scale = (t.reshape(*x.shape[:-1], t.shape[-1]) for t in xq.row_values())
        return fp8_linear_quantized_naive(x8, x_scale, w8, w_scale, x.dtype)
    M = x.numel() // max(1, K)
    if kernel == "torch_scaled_mm":
        from .torch_blockwise import SCALED_MM_PAD_ROWS, fp8_linear_torch

        if xq is None:
            from .triton_act_quant import quantize_rows_1x128_triton

            x8, x_scale_t = quantize_rows_1x128_triton(_row_major(x.reshape(M, K)), ue8m0, SCALED_MM_PAD_ROWS)
        else:
            x8, x_scale_t = xq.values, xq.scale_t
        out = fp8_linear_torch(x8, x_scale_t, w8, w_scale, M)
    else:
        from .triton_fp8_gemm import fp8_gemm_triton, fp8_linear_triton

        config = dense_config(M, N)
        if xq is None or config.fuse_quant:  # a fused launch quantizes inside the GEMM, from x itself
            out = fp8_linear_triton(_row_major(x.reshape(M, K)), w8, w_scale, ue8m0, config)
        else:
            out = fp8_gemm_triton(xq.values, xq.scale_t, w8, w_scale, M, x.dtype, config)
    return out.reshape(*x.shape[:-1], N)


def fp8_grouped_mm(
    a: torch.Tensor | Fp8Activation,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    ue8m0: bool | None = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row times its expert's block-quantized weight, transposed: the MoE experts' GEMM with FP8 weights.

    Args:
        a: [M, K] rows sorted by expert (`dsaflow.ops.moe.sort_by_expert`), quantized per 1x128 on the fly; with
            `gather`, [T, K] one row per token instead. Or an `Fp8Activation` of those rows (its source may be
            [..., K]: its rows flattened), read as it is.
        w8: float8_e4m3fn [E, N, K] one weight per expert (`quantize_blocks_128` of the [E, N, K] stack).
        w_scale: fp32 [E, ceil(N / 128), ceil(K / 128)] each expert's block scales.
        offsets: int32 [E] where each expert's rows end (cumulative; the layout of `dsaflow.ops.moe.grouped_mm`).
        ue8m0: power-of-two activation scales (None: as for `fp8_linear`).
        gather: None, or int64 [M]: row m of the GEMM is a[gather[m]]. The T token rows are quantized once and
            their e4m3 rows and scales gathered into expert order, bit-equal to quantizing the gathered rows (the
            quantization is per row) with k = M / T times fewer rows quantized and half the bytes gathered.

    Returns:
        [M, N] in a's dtype: row m = quantized a[m] times expert e(m)'s dequantized weight, transposed, fp32
        accumulation; rows past offsets[-1] are zero. Graph-safe on CUDA (the offsets are read on the device).
    """
    a, aq, ue8m0 = _unpack("fp8_grouped_mm", a, ue8m0)
    if aq is not None:
        a = aq.source.reshape(-1, aq.source.shape[-1])
    _check_grouped(a, w8, w_scale, offsets, gather)
    # the kernel is chosen for the GEMM's rows (with gather: M of them, not the T tokens): a view of that shape
    rows_shape = a if gather is None else a[:1].expand(gather.numel(), -1)
    kernel = chosen("fp8_grouped_mm", explain_fp8_gemm(rows_shape, w8, offsets), describe(a=rows_shape, w8=w8))
    if kernel == "reference" and aq is None:
        rows = a if gather is None else a.index_select(0, gather)
        return fp8_grouped_mm_naive(rows, w8, w_scale, offsets, ue8m0)
    M = a.shape[0]
    if aq is not None:
        x8, x_scale_t = aq.values, aq.scale_t
    else:
        from .triton_act_quant import quantize_rows_1x128_triton

        x8, x_scale_t = quantize_rows_1x128_triton(_row_major(a), ue8m0, 1)
    if gather is not None:  # e4m3 rows through a same-width integer view (index_select takes no float8 on CPU)
        x8 = x8[:M].view(torch.uint8).index_select(0, gather).view(FP8)
        x_scale_t = x_scale_t.index_select(1, gather)
        M = gather.numel()
    if kernel == "reference":  # an Fp8Activation on the reference: its rows as they are
        return fp8_grouped_mm_quantized_naive(x8[:M], x_scale_t[:, :M].t(), w8, w_scale, offsets, a.dtype)
    if kernel == "gluon":
        from .gluon_fp8_grouped import fp8_grouped_mm_gluon

        return fp8_grouped_mm_gluon(x8, x_scale_t, w8, w_scale, offsets, M, a.dtype)
    from .triton_fp8_grouped import fp8_grouped_mm_triton

    return fp8_grouped_mm_triton(x8, x_scale_t, w8, w_scale, offsets, M, a.dtype)


def _check_grouped(a, w8, w_scale, offsets, gather) -> None:
    """ValueError unless a is [M, K] rows for w8 [E, N, K], offsets int32 [E] and gather None or int64 [M], all on
    a's device."""
    _check_weight("fp8_grouped_mm", a, w8, w_scale, dims=3)
    if a.dim() != 2 or offsets.shape != (w8.shape[0],) or offsets.dtype != torch.int32 or offsets.device != a.device:
        raise ValueError(
            f"fp8_grouped_mm: a must be [M, K] and offsets int32 [{w8.shape[0]}] on a's device, got a "
            f"{tuple(a.shape)}, offsets {offsets.dtype} {tuple(offsets.shape)} on {offsets.device}"
        )
    if gather is not None and (gather.dim() != 1 or gather.dtype != torch.int64 or gather.device != a.device):
        raise ValueError(f"fp8_grouped_mm: gather must be int64 [M] on a's device, got {gather.dtype} "
                         f"{tuple(gather.shape)} on {gather.device}")  # fmt: skip


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block-quantized weight as a plain matrix.

    Args:
        w8: float8_e4m3fn [..., N, K] (one weight or an expert stack; last dim contiguous).
        scale: fp32 [..., ceil(N / 128), ceil(K / 128)] its block scales.
        dtype: the output's dtype.

    Returns:
        a new [..., N, K] in `dtype`, bit-equal to `dequantize_blocks_128(w8, scale).to(dtype)`: one Triton pass on
        CUDA (`triton_dequant.py`; graph-safe); on CPU whole blocks broadcast their scales (the same products, none
        materialised per element) and partial blocks take the reference.
    """
    if not w8.is_cuda:
        N, K = w8.shape[-2:]
        if N % BLOCK or K % BLOCK:
            return dequantize_blocks_128(w8, scale).to(dtype)
        blocked = w8.view(*w8.shape[:-2], N // BLOCK, BLOCK, K // BLOCK, BLOCK).to(torch.float32)
        return (blocked * scale[..., :, None, :, None]).to(dtype).view(w8.shape)
    from .triton_dequant import dequantize_blocks_128_triton

    return dequantize_blocks_128_triton(w8, scale, dtype)


__all__ = [
    "Fp8Activation",
    "dequantize_blocks_128",
    "dequantize_weight",
    "dequantize_rows_1x128",
    "explain_fp8_gemm",
    "fp8_grouped_mm",
    "fp8_grouped_mm_naive",
    "fp8_linear",
    "fp8_linear_naive",
    "quantize_activation",
    "quantize_blocks_128",
    "quantize_rows_1x128",
    "shared_fp8_input",
]
