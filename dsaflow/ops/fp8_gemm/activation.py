"""An activation quantized once for every FP8 GEMM that reads it.

A DSA layer feeds one normed hidden state to several projections: wq_a, wkv_a and the indexer's wk in attention,
the shared expert's w1 and w3 and the routed experts in a MoE layer. With FP8 weights each of those GEMMs would
quantize its input per 1x128 on its own: at 8192 prefill tokens of DeepSeek-V3.2 one pass over [8192, 7168] bf16
takes about as long as the indexer's wk GEMM itself. So the layer quantizes the input once (`shared_fp8_input`) and
hands the result, an `Fp8Activation`, to each of those GEMMs (`fp8_linear`, `fp8_grouped_mm`) in place of x.

`shared_fp8_input` quantizes only when some GEMM would read a separately quantized input: not for bf16 weights,
not where the reference kernel runs (it quantizes inside its fp32 computation), and not where every GEMM is a dense
Triton launch that fuses the quantization into its activation loads (`tile_configs` may pick such launches for few
rows); those launches, handed an Fp8Activation, read its source. A CUDA-graph capture records the one
quantization kernel and the GEMMs reading its output, so replays share it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dispatch import reads_quantized_input
from .naive import FP8, quantize_rows_1x128

# every shared quantization's rows are padded to this multiple: cuBLASLt's scale layout wants 4 (`torch_blockwise`);
# the Triton and Gluon GEMMs read the first M rows of any padded buffer, so one padded copy serves all of them
SHARED_PAD_ROWS = 4


@dataclass(frozen=True, eq=False)
class Fp8Activation:
    """An activation x [..., K] with its 1x128 quantization, made by `quantize_activation`.

    Attributes:
        source: x itself. It gives the GEMMs' output shape ([..., N]) and dtype, and the dense Triton launches that
            fuse the quantization (few rows) read it instead of `values`, as they would given x.
        values: float8_e4m3fn [M_pad, K], x's M = x.numel() / K rows quantized (rows past M are zeros), M_pad = M
            rounded up to SHARED_PAD_ROWS.
        scale_t: fp32 [ceil(K / 128), M_pad], the scales K-block-major (`triton_act_quant`'s layout; scale_t.t() is
            what torch's scaled_mm takes); padding rows have scale 1.
        ue8m0: whether the scales are powers of two.
        version: x's version counter when quantized: a GEMM handed this after an in-place write to x refuses it.
    """

    source: torch.Tensor
    values: torch.Tensor
    scale_t: torch.Tensor
    ue8m0: bool
    version: int

    @property
    def rows(self) -> int:
        """M, the activation's rows (source's leading dims flattened)."""
        return self.source.numel() // max(1, self.source.shape[-1])

    def row_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 [M, K], fp32 scales [M, ceil(K / 128)]): `quantize_rows_1x128(source rows)`'s pair, as views."""
        M = self.rows
        return self.values[:M], self.scale_t[:, :M].t()

    def check_current(self, op: str) -> None:
        """ValueError if the source was written in place since it was quantized (the values would be stale)."""
        if self.source._version != self.version:
            raise ValueError(
                f"{op}: the activation was written in place after quantize_activation (version {self.version} -> "
                f"{self.source._version}); quantize it again after the write"
            )


def quantize_activation(x: torch.Tensor, ue8m0: bool = False) -> Fp8Activation:
    """x [..., K] (bf16, fp16 or fp32) quantized per 1x128 once, for every FP8 GEMM that reads it: the Triton
    quantization kernel on CUDA, `quantize_rows_1x128` elsewhere (bit-equal). Rows padded to SHARED_PAD_ROWS."""
    if not x.is_floating_point() or x.dtype == FP8 or x.dim() == 0:
        raise ValueError(f"quantize_activation: x must be a float tensor [..., K], got {x.dtype} {tuple(x.shape)}")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if x.is_cuda:
        from .triton_act_quant import quantize_rows_1x128_triton

        values, scale_t = quantize_rows_1x128_triton(x2, ue8m0, SHARED_PAD_ROWS)
    else:
        values, scale = quantize_rows_1x128(x2, ue8m0)
        pad = -x2.shape[0] % SHARED_PAD_ROWS
        values = torch.cat([values, values.new_zeros(pad, K)]) if pad else values
        scale_t = F.pad(scale.t(), (0, pad), value=1.0).contiguous()
    return Fp8Activation(source=x, values=values, scale_t=scale_t, ue8m0=ue8m0, version=x._version)


def shared_fp8_input(x: torch.Tensor, *weights: torch.Tensor, ue8m0: bool = False) -> Fp8Activation | None:
    """x quantized once for the GEMMs of x by `weights` (a layer's projections that read x), or None.

    Args:
        x: [..., K] the shared input.
        weights: each a projection's weight: float8_e4m3fn [N, K] (`fp8_linear`) or [E, N, K] (`fp8_grouped_mm`
            over x's rows); weights of any other dtype (bf16 layers) are not FP8 GEMMs and are skipped.
        ue8m0: power-of-two activation scales.

    Returns:
        `quantize_activation(x)` when at least one of those FP8 GEMMs reads a separately quantized input
        (`dispatch.reads_quantized_input`); None when none does (no FP8 weight, the reference kernel, fused launches
        only) or when x needs a gradient (an Fp8Activation carries none): each GEMM then takes x as it is.
    """
    fp8 = [w for w in weights if w.dtype == FP8]
    if not fp8 or (torch.is_grad_enabled() and x.requires_grad):
        return None
    if any(reads_quantized_input(x, w) for w in fp8):
        return quantize_activation(x, ue8m0)
    return None
