"""Which sparse MLA kernel runs a call, forward and backward: one table of (kernel, pass, capability rule), walked
in order by `explain_sparse_mla`.

| kernel           | pass     | runs when                                                                          |
|------------------|----------|------------------------------------------------------------------------------------|
| `reference`      | forward  | CPU tensors (`naive.py`, fp32 math; autograd differentiates it)                    |
| `empty`          | forward  | no query, key slot or kv row: nothing to launch (out 0, lse -inf, zero gradients)  |
| `hopper_seesaw`  | forward  | sm_90, DeepSeek MLA shapes (d_qk 576, d_v 512, H % 64 == 0), bf16/fp16, triton     |
|                  |          | 3.6's Gluon; without grad also only when its grid covers at least half the SMs     |
| `triton_prefill` | forward  | grad; bf16/fp16/fp32, 0 < d_v <= 512, 0 <= d_qk - d_v <= 128 (fp32: d_qk <= 256)   |
| `triton_decode`  | forward  | no grad; the same shapes (split-K over the selected rows); also kv as a packed FP8 |
|                  |          | cache (uint8 rows of dsaflow.ops.kv_fp8, serve.kv_dtype=fp8; sm_89+), read in      |
|                  |          | place and dequantized in registers                                                 |
| `cudnn`          | backward | cuDNN-Frontend's CuTe DSL backward (`cudnn_backward.py`, the optional `peers`      |
|                  |          | extra) imports; sm_90 (H >= 2) or sm_100/sm_103 (H 16/32/64/96/128); bf16/fp16;    |
|                  |          | d_qk 512 or 576 with d_v 512; q and kv under 2^31 elements; lse gets no gradient;  |
|                  |          | not deterministic mode (on sm_100/sm_103 its deterministic kernels run it)         |
| `hopper`         | backward | dsaflow's backward with the Gluon pass 1 (`hopper_backward.py`): the shapes of     |
|                  |          | `hopper_seesaw`; every need is met (its dq and dkv kernels are `triton`'s)         |
| `triton`         | backward | always (dsaflow's portable backward, `triton_backward.py`)                         |

With grad, the chosen forward runs inside `SparseMLAFunction` (`function.py`), which walks the backward rows when
its backward runs (the lse gradient and the deterministic switch are known only then). With an indexer-loss target
(`probs_into`) dsaflow's pass 1 sums the attention probabilities it recomputes anyway; after cuDNN-Frontend's
backward, which returns none, `triton_probs.py` recomputes them from the saved lse (`TARGET_PASS_AFTER`).

Two process-wide variables (read once per process) restrict the table; a forced choice that refuses a call raises
with the reasons, there is no silent slow path:
- `DSAFLOW_SPARSE_MLA_KERNEL` (forward): "triton" (the portable kernels), "hopper" (the Gluon one), or one kernel
  name; "auto" or unset is the table.
- `DSAFLOW_SPARSE_MLA_BACKWARD`: "dsaflow" (`hopper` where it takes the call, else `triton`), "hopper", "triton" or
  "cudnn"; "auto" or unset is the table.
Rules read shapes, dtypes, the device and process-wide switches only, so a captured graph replays its kernels.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from dsaflow.errors import PlanError

from ..kernel_table import Choice, walk
from . import cudnn_backward as cb
from .determinism import is_deterministic

# The kernel modules (triton_*, hopper_*) import triton, which costs a process about 0.3 s: the rules that ask them
# import them when they run, i.e. on CUDA tensors only (the reference rule takes every CPU call first).

ENV_KERNEL = "DSAFLOW_SPARSE_MLA_KERNEL"
ENV_BACKWARD = "DSAFLOW_SPARSE_MLA_BACKWARD"
FORWARD, BACKWARD = "forward", "backward"
FAMILIES = {"triton": frozenset({"triton_prefill", "triton_decode"}), "hopper": frozenset({"hopper_seesaw"})}
ALWAYS_ALLOWED = frozenset({"reference", "empty"})  # not kernels a user can force away
BACKWARD_SETTINGS = ("auto", "dsaflow", "cudnn", "hopper", "triton")
TARGET_PASS_AFTER = frozenset({"cudnn"})  # backwards that return no probabilities: `triton_probs.py` adds the target

MAX_D_V = 512  # the fp32 accumulator [64, 512] is the most two warpgroups' registers hold
MAX_D_TAIL = 128
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Needs:
    """What a call asks beyond its outputs. Forward: grad (a backward will follow). Backward: an lse gradient, the
    indexer-loss target, bit-reproducibility."""

    grad: bool = False
    lse_grad: bool = False
    probs_into: bool = False
    deterministic: bool = False


def kernel_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if the portable Triton kernels take these shapes, else the reason they do not."""
    d_qk = q.shape[-1]
    if kv.dtype == torch.uint8:  # a packed FP8 cache (serve.kv_dtype=fp8), dequantized in the kernel's registers
        if (reason := fp8_cache_reason(q, kv, d_v)) is not None:
            return reason
    elif q.dtype not in _DTYPES or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (kernels take bf16/fp16/fp32 with q.dtype == kv.dtype)"
    if not 0 < d_v <= MAX_D_V or not 0 <= d_qk - d_v <= MAX_D_TAIL:
        return f"d_v={d_v}, d_qk={d_qk} (kernels take 0 < d_v <= {MAX_D_V} and 0 <= d_qk - d_v <= {MAX_D_TAIL})"
    if q.dtype == torch.float32 and d_qk > 256:
        return f"fp32 with d_qk={d_qk} > 256 (the fp32 tiles do not fit in shared memory; use bf16)"
    return None


def fp8_cache_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str | None:
    """None if the Triton kernels read kv as a packed FP8 cache for q, else why not: the bytes must match the
    format (`ops.kv_fp8.fp8_format_of`), q bf16/fp16/fp32, rows 4-byte aligned, fp8 loads need sm_89+."""
    from dsaflow.ops.kv_fp8 import fp8_format_of

    if q.dtype not in _DTYPES:
        return f"q dtype {q.dtype} (the FP8 cache is read with bf16/fp16/fp32 queries)"
    if fp8_format_of(kv, d_v, q.shape[-1] - d_v) is None:
        return f"a uint8 kv of {kv.shape[-1]} bytes per row is no FP8 cache of d_v={d_v}, d_qk={q.shape[-1]}"
    if kv.stride(-1) != 1 or kv.stride(0) % 4 or kv.stride(1) % 4:
        return f"FP8 cache strides {tuple(kv.stride())} (rows must start 4-byte aligned: fp32 scales)"
    cap = device_capability(q)
    if cap is not None and cap < (8, 9):
        return (
            f"sm_{cap[0]}{cap[1]}: serve.kv_dtype=fp8 needs fp8 loads (compute capability 8.9+); "
            "set serve.kv_dtype=bf16"
        )
    return None


def no_grad_takes_hopper_forward(q: torch.Tensor, indices: torch.Tensor, d_v: int) -> bool:
    """Without grad, the Hopper forward (one work item per query and 64-head block, whole key range) runs when its
    items cover at least half the SMs, i.e. where the split-K kernel would take at most 2 splits; below that the
    split-K kernel's extra programs win (`scripts/bench_hopper.py --part decode` of commit 7881c5d, docs/kernels.md)."""
    from .triton_decode import choose_num_splits
    from .triton_prefill import fwd_config

    cfg = fwd_config(q, d_v, q.shape[-1] - d_v, indices.shape[2])
    return choose_num_splits(q, indices.shape[2], cfg["BLOCK_H"], cfg["BLOCK_K"]) <= 2


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) of t's CUDA device, None off CUDA (a hook the CPU tests replace)."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


# ---- the capability rules: (q, kv, indices, d_v, needs) -> None or the reason ----


def _reference_rule(q, kv, indices, d_v, needs):
    return f"device {q.device.type} runs the kernels" if q.is_cuda else None


def _empty_rule(q, kv, indices, d_v, needs):
    empty = kv.shape[1] == 0 or indices.shape[-1] == 0 or q.shape[0] * q.shape[1] * q.shape[2] == 0
    return None if empty else "inputs are not empty"


def _seesaw_rule(q, kv, indices, d_v, needs):
    from .hopper_seesaw import hopper_fwd_supports

    reason = hopper_fwd_supports(q, kv, indices, d_v)
    if reason is None and not needs.grad and not no_grad_takes_hopper_forward(q, indices, d_v):
        return (
            f"no grad and {q.shape[0] * q.shape[1]} queries x {q.shape[2] // 64} head blocks cover under half "
            f"the SMs (the split-K decode is faster there)"
        )
    return reason


def _triton_prefill_rule(q, kv, indices, d_v, needs):
    if not needs.grad:
        return "no grad (triton_decode runs it as one split, or splits the keys)"
    if kv.dtype == torch.uint8:
        return "an FP8 cache is read without grad (serving), and no backward writes one"
    return kernel_supports(q, kv, indices, d_v)


def _triton_decode_rule(q, kv, indices, d_v, needs):
    return "no backward (serves calls without grad)" if needs.grad else kernel_supports(q, kv, indices, d_v)


def _cudnn_rule(q, kv, indices, d_v, needs):
    cap = device_capability(q)
    if cap is None:
        return f"device {q.device.type} (cuDNN-Frontend runs on CUDA)"
    sm100 = cap in cb.SM100_CAPABILITIES
    if cap[0] != 9 and not sm100:
        return f"sm_{cap[0]}{cap[1]} (cuDNN-Frontend's DSA backward runs on sm_90, sm_100 and sm_103)"
    missing = cb.cudnn_import_error()
    if missing is not None:
        return missing
    B, T, H, d_qk = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (cuDNN-Frontend takes bf16/fp16 with q.dtype == kv.dtype)"
    if d_qk not in cb.D_QK_SUPPORTED or d_v != cb.D_V:
        return f"d_qk={d_qk}, d_v={d_v} (cuDNN-Frontend takes d_qk 512 or 576 with d_v {cb.D_V})"
    if sm100 and H not in cb.SM100_HEADS:
        return f"H={H} on sm_{cap[0]}{cap[1]} (cuDNN-Frontend's sm_100 kernels take H in {cb.SM100_HEADS})"
    if H < cb.SM90_MIN_HEADS:
        return f"H={H} (cuDNN-Frontend's kernels take MQA: H >= {cb.SM90_MIN_HEADS})"
    if max(q.numel(), kv.numel()) >= cb.INT32_ELEMENTS:
        return "q or kv of 2^31 elements or more (not validated with cuDNN-Frontend; run smaller query chunks)"
    if needs.lse_grad:
        return "lse receives a gradient (cuDNN-Frontend's backward takes none)"
    if needs.deterministic and not (sm100 and H in cb.SM100_HEADS):
        return "deterministic mode (cuDNN-Frontend's backward adds dkv with atomics on sm_90)"
    return None


def _hopper_backward_rule(q, kv, indices, d_v, needs):
    from .hopper_backward import hopper_bwd_supports

    return hopper_bwd_supports(q, kv, indices, d_v)


def _triton_backward_rule(q, kv, indices, d_v, needs):
    return None  # it takes every call the forward kernels take


KERNELS = (
    ("reference", FORWARD, _reference_rule),
    ("empty", FORWARD, _empty_rule),
    ("hopper_seesaw", FORWARD, _seesaw_rule),
    ("triton_prefill", FORWARD, _triton_prefill_rule),
    ("triton_decode", FORWARD, _triton_decode_rule),
    ("cudnn", BACKWARD, _cudnn_rule),
    ("hopper", BACKWARD, _hopper_backward_rule),
    ("triton", BACKWARD, _triton_backward_rule),
)
FORWARD_NAMES = tuple(name for name, step, _ in KERNELS if step == FORWARD)
BACKWARD_NAMES = tuple(name for name, step, _ in KERNELS if step == BACKWARD)


@functools.lru_cache(maxsize=1)
def forced_kernels() -> tuple[str, frozenset[str] | None]:
    """(`DSAFLOW_SPARSE_MLA_KERNEL`'s value, the forward kernels it allows; None: all), read once per process."""
    want = os.environ.get(ENV_KERNEL, "auto")
    if want == "auto":
        return want, None
    if want in FAMILIES:
        return want, FAMILIES[want] | ALWAYS_ALLOWED
    if want in FORWARD_NAMES and want not in ALWAYS_ALLOWED:
        return want, frozenset({want}) | ALWAYS_ALLOWED
    choices = ["auto", *FAMILIES, *(n for n in FORWARD_NAMES if n not in ALWAYS_ALLOWED)]
    raise ValueError(f"{ENV_KERNEL}={want!r}: use one of {', '.join(choices)}.")


@functools.lru_cache(maxsize=1)
def forced_backward() -> tuple[str, frozenset[str] | None]:
    """(`DSAFLOW_SPARSE_MLA_BACKWARD`'s value, the backwards it allows; None: all), read once per process."""
    want = os.environ.get(ENV_BACKWARD, "auto").strip().lower() or "auto"
    if want not in BACKWARD_SETTINGS:
        raise PlanError(
            f"{ENV_BACKWARD}={os.environ.get(ENV_BACKWARD)!r}: use one of {', '.join(BACKWARD_SETTINGS)} "
            "(auto: the dispatch rule; dsaflow: always dsaflow's backward; cudnn: always cuDNN-Frontend's; hopper / "
            "triton: dsaflow's backward with that pass 1)."
        )
    allowed = {"auto": None, "dsaflow": frozenset(n for n in BACKWARD_NAMES if n != "cudnn")}
    allowed.update({name: {name} for name in BACKWARD_NAMES})
    return want, None if allowed[want] is None else frozenset(allowed[want])


def check_forced_backward() -> None:
    """Raise at the forward, not after it, when `DSAFLOW_SPARSE_MLA_BACKWARD=cudnn` and cuDNN-Frontend is missing."""
    if forced_backward()[0] == "cudnn" and (missing := cb.cudnn_import_error()) is not None:
        raise PlanError(f"{ENV_BACKWARD}=cudnn: {missing}; or set {ENV_BACKWARD}=auto.")


def normalised(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor):
    """Unit last strides and int32 indices: what every kernel reads (and what the rules check)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32)
    return q, kv, indices if indices.stride(-1) == 1 else indices.contiguous()


def explain_sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    d_v: int,
    grad: bool | None = None,
    *,
    backward: bool = False,
    lse_grad: bool = False,
    probs_into: bool = False,
    deterministic: bool | None = None,
) -> Choice:
    """Which kernel a `sparse_mla(q, kv, indices, ..., d_v)` call runs and why each earlier candidate was refused.
    Runs nothing. Forward (default): grad defaults to whether this call would need a backward. backward=True: the
    backward of a differentiable call, asked for an lse gradient, the indexer-loss target (`cudnn` then means
    cuDNN-Frontend's dq and dkv followed by the target pass) and bit-reproducibility (default: `is_deterministic()`
    now).

        >>> print(explain_sparse_mla(q, kv, idx, 512))
        runs triton_decode (refused: reference: device cuda runs the kernels; empty: ...)"""
    if backward:
        step, (setting, allowed), env = BACKWARD, forced_backward(), ENV_BACKWARD
        det = is_deterministic() if deterministic is None else deterministic
        needs = Needs(grad=True, lse_grad=lse_grad, probs_into=probs_into, deterministic=det)
    else:
        step, (setting, allowed), env = FORWARD, forced_kernels(), ENV_KERNEL
        if grad is None:
            grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
        needs = Needs(grad=grad)
    table = [(name, rule) for name, row_step, rule in KERNELS if row_step == step]
    return walk(table, *normalised(q, kv, indices), d_v, needs, allowed=allowed, excluded_by=f"{env}={setting}")
