"""Which kernel runs a block-scaled FP8 GEMM: one table of (kernel, capability rule) for the dense and the grouped
form, walked by `explain_fp8_gemm`.

| kernel            | runs when                                                                                     |
|-------------------|-----------------------------------------------------------------------------------------------|
| `reference`       | CPU tensors (`naive.py`); on CUDA only when forced (DSAFLOW_FP8_GEMM=reference)                |
| `torch_scaled_mm` | dense, bf16, sm_90, more than 64 rows, K and N multiples of 16, w8 contiguous, and a torch     |
|                   | whose `torch.nn.functional.scaled_mm` takes BlockWise1x128 / BlockWise128x128 scales (2.10+, CUDA 12.9+) |
| `gluon`           | grouped, sm_90, more than 64 rows per expert on average, K a multiple of 16, w8 contiguous, and a  |
|                   | triton with Gluon's Hopper TMA and wgmma (`gluon_fp8_grouped.py`)                              |
| `triton`          | any other CUDA call on fp8 tensor cores (compute capability 8.9+), bf16/fp16/fp32 activations     |

`torch_scaled_mm` is cuBLASLt's kernel for DeepSeek's recipe (`torch_blockwise.py`); torch refuses it off sm_90.
K and N need only cuBLASLt's 16-byte alignment: its block scaling takes a partial last 128-block (MLA's wkv_a, N = 576:
checked against the reference in tests/test_fp8_gemm_gpu.py; faster than Triton there, docs/kernels.md has the
numbers); other widths run on Triton.
torch has no grouped form of these scales, so grouped calls go to the Gluon kernel where it is faster (prefill: many
rows per expert) and to `triton` (`triton_fp8_grouped.py`) otherwise. Either way the activations are first quantized
by `triton_act_quant.py`.

`DSAFLOW_FP8_GEMM` (auto | reference | torch_scaled_mm | gluon | triton; read at each call) restricts the table to one
kernel, for benchmarks and tests; a call the forced kernel refuses raises with its reason.
"""

from __future__ import annotations

import os

import torch

from ..kernel_table import Choice, chosen, describe, walk
from .tile_configs import dense_config
from .torch_blockwise import torch_support_reason

ENV_KERNEL = "DSAFLOW_FP8_GEMM"
# Up to this many rows a dense call is decode-like: the weight's bytes bound it, and Triton's split-K launches read
# them faster than cuBLASLt (bench_fp8.py --sweep on an H200: 16 rows 0.082 ms against 0.098 ms over V3.2's four
# dense weights, 64 rows 0.098 against 0.104); from 256 rows on cuBLASLt is faster (0.131 against 0.218 ms). A
# preference, not a capability: DSAFLOW_FP8_GEMM=torch_scaled_mm still runs cuBLASLt on few rows.
TRITON_MAX_DECODE_ROWS = 64
# Above this many rows per expert (mean) a grouped call on sm_90 runs the Gluon kernel: bench_fp8.py --sweep on an
# H200 at 128 rows per expert, V3.2's experts: 5.31 ms against 5.95 for the best Triton launch (gate_up + down); at
# 16 rows per expert and fewer, where the weight's bytes bound the call, Triton's narrow tiles are faster (3.11
# against 3.68 ms). A preference: DSAFLOW_FP8_GEMM=gluon runs Gluon on any grouped call it supports.
GLUON_MIN_ROWS_PER_EXPERT = 65
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _forced() -> str:
    return os.environ.get(ENV_KERNEL, "auto")


def _reference_rule(x: torch.Tensor, w8: torch.Tensor, grouped: bool) -> str | None:
    if x.is_cuda and _forced() != "reference":
        return f"device cuda runs the kernels ({ENV_KERNEL}=reference runs it there)"
    return None


def _torch_rule(x: torch.Tensor, w8: torch.Tensor, grouped: bool) -> str | None:
    if not x.is_cuda:
        return f"device {x.device.type}: torch's block-scaled GEMM is cuBLASLt's (CUDA)"
    if grouped:
        return "grouped: torch.nn.functional.scaled_grouped_mm takes no 1x128 / 128x128 block scales"
    if (reason := torch_support_reason()) is not None:
        return reason
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != 9:
        return f"torch runs DeepSeek-style block scaling on sm_90 only; this GPU is sm_{major}{minor}"
    if x.dtype != torch.bfloat16:
        return f"bf16 activations only (its output dtype), not {x.dtype}"
    N, K = w8.shape[-2:]
    if K % 16 or N % 16:
        return f"K {K} and N {N} must be multiples of 16 (cuBLASLt's fp8 operand alignment)"
    if not w8.is_contiguous():
        return "w8 must be contiguous (cuBLASLt reads w8.t() column-major)"
    if _forced() == "auto" and (rows := x.numel() // max(1, K)) <= TRITON_MAX_DECODE_ROWS:
        return f"{rows} rows <= {TRITON_MAX_DECODE_ROWS}: Triton's split-K launch streams the weight faster"
    return None


def _gluon_rule(x: torch.Tensor, w8: torch.Tensor, grouped: bool) -> str | None:
    from .gluon_fp8_grouped import gluon_weight_reason

    if not grouped:
        return "dense: the Gluon kernel is the grouped GEMM only"
    if x.dtype not in ACTIVATION_DTYPES:
        return f"activations must be bf16, fp16 or fp32, not {x.dtype}"
    if (reason := gluon_weight_reason(x.device, w8)) is not None:
        return reason
    per_expert = x.shape[0] // max(1, w8.shape[0])
    if _forced() == "auto" and per_expert < GLUON_MIN_ROWS_PER_EXPERT:
        return (
            f"{per_expert} rows per expert < {GLUON_MIN_ROWS_PER_EXPERT}: Triton's narrow tiles read the weights faster"
        )
    return None


def _triton_rule(x: torch.Tensor, w8: torch.Tensor, grouped: bool) -> str | None:
    if not x.is_cuda:
        return f"device {x.device.type} has no Triton kernels"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) < (8, 9):
        return f"fp8 tensor cores need compute capability 8.9+; this GPU is sm_{major}{minor}"
    if x.dtype not in ACTIVATION_DTYPES:
        return f"activations must be bf16, fp16 or fp32, not {x.dtype}"
    if w8.stride(-1) != 1:
        return "w8 needs a unit stride along K (the kernels load 128-wide K rows)"
    return None


KERNELS = (
    ("reference", _reference_rule),
    ("torch_scaled_mm", _torch_rule),
    ("gluon", _gluon_rule),
    ("triton", _triton_rule),
)


def explain_fp8_gemm(x: torch.Tensor, w8: torch.Tensor, offsets: torch.Tensor | None = None) -> Choice:
    """The kernel for activations x [..., K] times fp8 weights w8 [N, K] (`fp8_linear`) or, given offsets, rows x
    [M, K] sorted by expert times w8 [E, N, K] (`fp8_grouped_mm`), and why earlier ones were refused. Runs
    nothing; the rules read shapes, dtypes, the device, torch's version and DSAFLOW_FP8_GEMM."""
    return _choose(x, w8, grouped=offsets is not None)


def _choose(x: torch.Tensor, w8: torch.Tensor, grouped: bool) -> Choice:
    forced = _forced()
    names = [name for name, _ in KERNELS]
    if forced not in ("auto", *names):
        raise ValueError(f"{ENV_KERNEL}={forced!r} is not an fp8 GEMM kernel: use auto or one of {', '.join(names)}.")
    allowed = None if forced == "auto" else frozenset([forced])
    return walk(KERNELS, x, w8, grouped, allowed=allowed, excluded_by=f"{ENV_KERNEL}={forced}")


def reads_quantized_input(x: torch.Tensor, w8: torch.Tensor) -> bool:
    """Whether the FP8 GEMM of activations x [..., K] by w8 reads x's 1x128 quantization as a tensor quantized
    before it (`activation.quantize_activation` can then hand it over): every kernel but the reference, which
    quantizes inside its fp32 computation, and the dense Triton launches whose `dense_config` fuses the quantization
    into the GEMM (few rows). A grouped w8 [E, N, K] is asked about x's rows, a dense w8 [N, K] about x."""
    grouped = w8.dim() == 3
    rows = x.numel() // max(1, x.shape[-1])
    kernel = chosen("fp8 GEMM", _choose(x, w8, grouped), describe(x=x, w8=w8))
    if kernel == "reference":
        return False
    return grouped or kernel != "triton" or not dense_config(rows, w8.shape[0]).fuse_quant
