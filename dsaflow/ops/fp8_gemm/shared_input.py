"""One activation quantization for every FP8 GEMM that reads the same input.

A DSA layer feeds one normed hidden state to several projections: wq_a, wkv_a and the indexer's wk in attention,
the shared expert's w1 and w3 and the routed experts in a MoE layer (MLA, MoE and SwiGLU open a block around
them; MLA's q_latent, read by wq_b and the indexer's wq_b, is not shared: its second quantization reads [tokens,
1536], a fifth of the hidden state's bytes). With FP8 weights each of those GEMMs would quantize its input per
1x128 on its own: at 8192 prefill tokens of DeepSeek-V3.2 one pass over [8192, 7168] bf16 takes about as long as
the indexer's wk GEMM itself. Inside `quantize_once(x, ...)`, the first GEMM on x (or on a view of it with the same
rows) quantizes it and the others reuse those e4m3 rows and scales.

Reuse is safe because the quantization is a function of x's values alone, and a cached entry is valid only while
x's version counter is unchanged: an in-place write to x between two GEMMs makes the next one quantize afresh. The
entries live until the block exits (no quantized copy outlives its layer), and a CUDA-graph capture records the one
quantization kernel and the GEMMs reading its output, so replays reuse it the same way. Kernels that fuse the
quantization into the GEMM (the decode launches of `triton_fp8_gemm`) never ask for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

# pad every shared quantization's rows to this multiple: cuBLASLt's scale layout wants 4 (`torch_blockwise`); the
# Triton and Gluon GEMMs read the first M rows of any padded buffer, so one padded copy serves all of them
SHARED_PAD_ROWS = 4

_local = threading.local()


def _key(x2: torch.Tensor) -> tuple:
    """What identifies x2's values while its version is unchanged: storage address, dtype, shape and strides."""
    return (x2.data_ptr(), x2.dtype, tuple(x2.shape), x2.stride())


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@contextlib.contextmanager
def quantize_once(*xs: torch.Tensor) -> Iterator[None]:
    """Within the block, the FP8 GEMMs (`fp8_linear`, `fp8_grouped_mm`) whose activations are one of xs (the tensor,
    or any view with the same [rows, K] layout) quantize it once, on first use, and share the result; other
    activations are quantized per call as usual. Blocks nest. The reference kernels (CPU) quantize inside their
    own computation and never ask."""
    frames = _local.__dict__.setdefault("frames", [])
    # per entry: [x (held so its address cannot be reused), version at quantization, {ue8m0: (x8, scale_t)}]
    frame = {_key(_rows(x)): [x, None, {}] for x in xs}
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()


def shared_quantization(x2: torch.Tensor, ue8m0: bool, pad_rows: int, quantize: Callable) -> tuple | None:
    """(x8 [M_pad, K], scale_t [ceil(K / 128), M_pad]) for x2 [M, K] when an enclosing `quantize_once` shares it:
    the cached pair, or `quantize(x2, ue8m0, SHARED_PAD_ROWS)` stored for the next GEMM; None when x2 is not shared
    (the caller quantizes it itself). pad_rows must divide SHARED_PAD_ROWS."""
    for frame in reversed(_local.__dict__.get("frames", ())):
        entry = frame.get(_key(x2))
        if entry is None:
            continue
        if SHARED_PAD_ROWS % pad_rows:
            return None
        _held, version, by_format = entry
        if version != x2._version:  # written in place since: quantize afresh
            by_format.clear()
            entry[1] = x2._version
        if ue8m0 not in by_format:
            by_format[ue8m0] = quantize(x2, ue8m0, SHARED_PAD_ROWS)
        return by_format[ue8m0]
    return None
