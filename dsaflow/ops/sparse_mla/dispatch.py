"""Which sparse MLA kernel runs a call: one table of (kernel, capability rule), walked in order.

| kernel           | runs when                                                                               |
|------------------|-----------------------------------------------------------------------------------------|
| `reference`      | CPU tensors (`naive.py`, fp32 math)                                                     |
| `empty`          | no query, key slot or kv row: nothing to launch (out 0, lse -inf, zero gradients)       |
| `hopper_seesaw`  | sm_90, DeepSeek MLA shapes (d_qk 576, d_v 512, H % 64 == 0), bf16/fp16, triton 3.6      |
|                  | Gluon; without grad also only when its grid covers at least half the SMs                |
| `hopper_decode`  | no grad, exactly 16 heads per query (a TP-8 shard), sm_90, the same shapes              |
| `triton_prefill` | grad; bf16/fp16/fp32, 0 < d_v <= 512, 0 <= d_qk - d_v <= 128 (fp32: d_qk <= 256)        |
| `triton_decode`  | no grad; the same shapes (split-K over the selected rows; one split = the prefill kernel)|

With grad the chosen forward runs inside `SparseMLAFunction`, whose backward has its own table
(`backward_dispatch.py`: dsaflow's Triton backward, or cuDNN-Frontend's where installed). A CUDA call no
kernel takes raises ValueError with the shape and every candidate's reason: there is no silent slow path.
`explain_sparse_mla(q, kv, indices, d_v, grad)` returns the `Choice` for given inputs without running anything.

`DSAFLOW_SPARSE_MLA_KERNEL` (read once per process) restricts the CUDA kernels: "triton" (the portable kernels),
"hopper" (the Gluon kernels), or one kernel name; "auto" or unset is the table above. A forced choice that no
allowed kernel takes raises with the reasons.
"""

from __future__ import annotations

import functools
import os

import torch

from ..kernel_table import Choice, walk
from .function import SparseMLAFunction
from .hopper_decode import DECODE_BLOCK_H, hopper_decode_supports, sparse_mla_decode_hopper
from .hopper_seesaw import hopper_fwd_supports, sparse_mla_fwd_hopper
from .naive import sparse_mla_naive
from .triton_decode import choose_num_splits, sparse_mla_decode_triton
from .triton_prefill import fwd_config

ENV_KERNEL = "DSAFLOW_SPARSE_MLA_KERNEL"
FAMILIES = {
    "triton": frozenset({"triton_prefill", "triton_decode"}),
    "hopper": frozenset({"hopper_seesaw", "hopper_decode"}),
}
ALWAYS_ALLOWED = frozenset({"reference", "empty"})  # not kernels a user can force away

MAX_D_V = 512  # the fp32 accumulator [64, 512] is the most two warpgroups' registers hold
MAX_D_TAIL = 128
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_supports(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    """None if the portable Triton kernels take these shapes, else the reason they do not."""
    d_qk = q.shape[-1]
    if q.dtype not in _DTYPES or kv.dtype != q.dtype:
        return f"dtypes q={q.dtype} kv={kv.dtype} (kernels take bf16/fp16/fp32 with q.dtype == kv.dtype)"
    if not 0 < d_v <= MAX_D_V or not 0 <= d_qk - d_v <= MAX_D_TAIL:
        return f"d_v={d_v}, d_qk={d_qk} (kernels take 0 < d_v <= {MAX_D_V} and 0 <= d_qk - d_v <= {MAX_D_TAIL})"
    if q.dtype == torch.float32 and d_qk > 256:
        return f"fp32 with d_qk={d_qk} > 256 (the fp32 tiles do not fit in shared memory; use bf16)"
    return None


def no_grad_takes_hopper_forward(q: torch.Tensor, indices: torch.Tensor, d_v: int) -> bool:
    """Without grad, the Hopper forward (one work item per query and 64-head block, whole key range) runs when its
    items cover at least half the SMs, i.e. where the split-K kernel would take at most 2 splits; below that the
    split-K kernel's extra programs win (`scripts/bench_hopper.py --part decode`, docs/kernels.md). Shape-only."""
    cfg = fwd_config(q, d_v, q.shape[-1] - d_v, indices.shape[2])
    return choose_num_splits(q, indices.shape[2], cfg["BLOCK_H"], cfg["BLOCK_K"]) <= 2


def _is_empty(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    return kv.shape[1] == 0 or indices.shape[-1] == 0 or q.shape[0] * q.shape[1] * q.shape[2] == 0


# ---- the capability rules: (q, kv, indices, d_v, grad) -> None or the reason ----


def _reference_rule(q, kv, indices, d_v, grad):
    return f"device {q.device.type} runs the kernels" if q.is_cuda else None


def _empty_rule(q, kv, indices, d_v, grad):
    return None if _is_empty(q, kv, indices) else "inputs are not empty"


def _seesaw_rule(q, kv, indices, d_v, grad):
    reason = hopper_fwd_supports(q, kv, indices, d_v)
    if reason is None and not grad and not no_grad_takes_hopper_forward(q, indices, d_v):
        return (
            f"no grad and {q.shape[0] * q.shape[1]} queries x {q.shape[2] // 64} head blocks cover under half "
            f"the SMs (the split-K decode is faster there)"
        )
    return reason


def _hopper_decode_rule(q, kv, indices, d_v, grad):
    if grad:
        return "no backward (serves calls without grad)"
    if q.shape[2] != DECODE_BLOCK_H:
        return (
            f"H={q.shape[2]} (serves exactly {DECODE_BLOCK_H} heads; with more, each 16-head program would "
            f"gather every row again)"
        )
    return hopper_decode_supports(q, kv, indices, d_v)


def _triton_prefill_rule(q, kv, indices, d_v, grad):
    if not grad:
        return "no grad (triton_decode runs it as one split, or splits the keys)"
    return kernel_supports(q, kv, indices, d_v)


def _triton_decode_rule(q, kv, indices, d_v, grad):
    return "no backward (serves calls without grad)" if grad else kernel_supports(q, kv, indices, d_v)


KERNELS = (
    ("reference", _reference_rule),
    ("empty", _empty_rule),
    ("hopper_seesaw", _seesaw_rule),
    ("hopper_decode", _hopper_decode_rule),
    ("triton_prefill", _triton_prefill_rule),
    ("triton_decode", _triton_decode_rule),
)
KERNEL_NAMES = tuple(name for name, _ in KERNELS)


@functools.lru_cache(maxsize=1)
def forced_kernels() -> tuple[str, frozenset[str] | None]:
    """(`DSAFLOW_SPARSE_MLA_KERNEL`'s value, the kernels it allows; None: all), read once per process."""
    want = os.environ.get(ENV_KERNEL, "auto")
    if want == "auto":
        return want, None
    if want in FAMILIES:
        return want, FAMILIES[want] | ALWAYS_ALLOWED
    if want in KERNEL_NAMES and want not in ALWAYS_ALLOWED:
        return want, frozenset({want}) | ALWAYS_ALLOWED
    choices = ["auto", *FAMILIES, *(n for n in KERNEL_NAMES if n not in ALWAYS_ALLOWED)]
    raise ValueError(f"{ENV_KERNEL}={want!r}: use one of {', '.join(choices)}.")


def _normalised(q, kv, indices):
    """Unit last strides and int32 indices: what every kernel reads (and what the rules check)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32)
    return q, kv, indices if indices.stride(-1) == 1 else indices.contiguous()


def _choose(q, kv, indices, d_v: int, grad: bool, table=KERNELS) -> Choice:
    setting, allowed = forced_kernels()
    return walk(table, q, kv, indices, d_v, grad, allowed=allowed, excluded_by=f"{ENV_KERNEL}={setting}")


def explain_sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, grad: bool | None = None
) -> Choice:
    """Which kernel `sparse_mla(q, kv, indices, ..., d_v)` runs and why each earlier candidate was refused; grad
    defaults to whether this call would need a backward. Runs nothing.

        >>> print(explain_sparse_mla(q, kv, idx, 512))
        runs triton_decode (refused: reference: device cuda runs the kernels; empty: ...)"""
    if grad is None:
        grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    return _choose(*_normalised(q, kv, indices), d_v, grad)


def run_sparse_mla(q, kv, indices, sm_scale: float, d_v: int, probs_into=None, table=KERNELS):
    """Walk `table` for these inputs and run the chosen kernel (`sparse_mla`'s contract). probs_into is handed to
    the backward, so it needs a call with grad. Raises ValueError when no kernel takes the inputs."""
    grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    if probs_into is not None and not grad:
        raise ValueError("sparse_mla kernels: probs_into is filled by the backward, but this call has no gradient")
    given = q, kv, indices
    q, kv, indices = _normalised(q, kv, indices)
    choice = _choose(q, kv, indices, d_v, grad, table)
    if choice.kernel is None:
        forced = forced_kernels()[0]
        raise ValueError(
            f"sparse_mla: no kernel takes q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} {kv.dtype}, indices "
            f"{tuple(indices.shape)}, d_v={d_v}, grad={grad}"
            + (f", {ENV_KERNEL}={forced}" if forced != "auto" else "")
            + f": {choice.reasons()}"
        )
    sm_scale, d_v = float(sm_scale), int(d_v)
    if choice.kernel == "reference":
        return sparse_mla_naive(*given, sm_scale, d_v)
    if choice.kernel == "empty":
        return _empty_result(q, kv, indices, sm_scale, d_v)
    if grad:
        return SparseMLAFunction.apply(q, kv, indices, sm_scale, d_v, probs_into, choice.kernel)
    if choice.kernel == "hopper_seesaw":
        return sparse_mla_fwd_hopper(q, kv, indices, sm_scale, d_v)
    if choice.kernel == "hopper_decode":
        return sparse_mla_decode_hopper(q, kv, indices, sm_scale, d_v)
    return sparse_mla_decode_triton(q, kv, indices, sm_scale, d_v)


def sparse_mla_kernels(q, kv, indices, sm_scale: float, d_v: int, probs_into=None):
    """`run_sparse_mla` without the reference: the kernels on any device (CPU tensors run the Triton kernels in the
    interpreter, which is how the CPU tests reach them)."""
    return run_sparse_mla(q, kv, indices, sm_scale, d_v, probs_into, KERNELS[1:])


def _empty_result(q, kv, indices, sm_scale, d_v):
    """No query, no key slot or no kv row: out = 0, lse = -inf (every query has no key), through the reference so
    that gradients (zero) still reach q and kv."""
    B, T, H = q.shape[:3]
    if B * T * H == 0:
        out = q.new_zeros(B, T, H, d_v) + q.sum() * 0 + kv.sum() * 0
        return out, torch.full((B, T, H), float("-inf"), device=q.device)
    return sparse_mla_naive(q, kv, indices[..., :0], sm_scale, d_v)
