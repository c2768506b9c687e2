"""Which backward runs a differentiable sparse MLA call: one table of (backward, capability rule), walked in order.

| backward | runs when                                                                                           |
|----------|-----------------------------------------------------------------------------------------------------|
| `cudnn`  | cuDNN-Frontend's CuTe DSL backward (`cudnn_backward.py`, the optional `peers` extra) is importable;   |
|          | sm_90 (H >= 2) or sm_100/sm_103 (H 16/32/64/96/128); bf16/fp16; d_qk 512 or 576 with d_v 512; q and kv |
|          | under 2^31 elements; lse gets no gradient; not deterministic mode (on sm_100/sm_103 its deterministic  |
|          | kernels run it); and, unforced, no `OURS_FASTER` row. With an indexer-loss target (`probs_into`) it    |
|          | gives dq and dkv, and a separate Q.K^T pass (`triton_probs.py`) adds the target                      |
| `hopper` | dsaflow's backward with the warp-specialised Gluon pass 1 (`hopper_backward.py`): sm_90, triton 3.6's |
|          | Gluon, bf16/fp16, DeepSeek MLA dims (d_qk 576, d_v 512), H a multiple of 64 (`hopper_bwd_supports`)   |
| `triton` | always (dsaflow's portable backward, `triton_backward.py`; its pass 1 adds the target from its own P)  |

The indexer-loss target is the heads' attention probabilities, summed per slot and normalised. dsaflow's pass 1
recomputes P anyway and sums it in the same pass; cuDNN-Frontend's backward does not return P, so after it
`triton_probs.py` recomputes S = Q.K^T and P from the saved lse (2 H K d_qk FLOPs per query, about a fifth of the
backward's) and adds the target through the same adding kernel, deterministically. Why an lse gradient goes to
dsaflow's backward: cuDNN's backward takes none.

`DSAFLOW_SPARSE_MLA_BACKWARD` (read once per process): "auto" or unset is the table above, "dsaflow" runs dsaflow's
backward always (`hopper` where it takes the call, else `triton`), "hopper" or "triton" dsaflow's backward with that
pass 1, "cudnn" cuDNN-Frontend's (with the target pass where a target is asked for); a forced backward raises (naming
the variable, the reason and the fix) where it cannot take a call. The backward each process runs is logged once per
backward (and once more for cuDNN-Frontend's with the target pass) at INFO; `explain_sparse_mla_backward(...)` says
which runs and why without running anything. Without the extra installed the table picks `hopper` or `triton`,
silently.
Rules read shapes, dtypes, the device and process-wide switches only, so a captured graph replays its backward.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from dsaflow.errors import PlanError

from ..kernel_table import Choice, walk
from . import cudnn_backward as cb
from .determinism import is_deterministic
from .hopper_backward import hopper_bwd_supports
from .triton_backward import sparse_mla_bwd_triton
from .triton_probs import sparse_mla_probs_triton

ENV_BACKWARD = "DSAFLOW_SPARSE_MLA_BACKWARD"
SETTINGS = ("auto", "dsaflow", "cudnn", "hopper", "triton")
log = logging.getLogger("dsaflow.ops.sparse_mla")

# Shapes where dsaflow's backward measured faster than cuDNN-Frontend's, side by side in one process
# (`scripts/bench_ops.py --only peers`): (compute capability major, H, d_qk, top-k, lowest S, highest S), S the
# context (kv rows per sequence). Empty: cuDNN-Frontend is preferred wherever its rule takes the call.
OURS_FASTER: tuple[tuple[int, int, int, int, int, int], ...] = ()


@dataclass(frozen=True)
class BackwardNeeds:
    """What a backward call asks beyond dq and dkv: an lse gradient, the indexer-loss target, bit-reproducibility."""

    lse_grad: bool = False
    probs_into: bool = False
    deterministic: bool = False


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) of t's CUDA device, None off CUDA (a hook the CPU tests replace)."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


@functools.lru_cache(maxsize=1)
def forced_backward() -> tuple[str, frozenset[str] | None]:
    """(`DSAFLOW_SPARSE_MLA_BACKWARD`'s value, the backwards it allows; None: all), read once per process."""
    want = os.environ.get(ENV_BACKWARD, "auto").strip().lower() or "auto"
    if want not in SETTINGS:
        raise PlanError(
            f"{ENV_BACKWARD}={os.environ.get(ENV_BACKWARD)!r}: use one of {', '.join(SETTINGS)} "
            "(auto: the dispatch rule; dsaflow: always dsaflow's backward; cudnn: always cuDNN-Frontend's; hopper / "
            "triton: dsaflow's backward with that pass 1)."
        )
    allowed = {"auto": None, "dsaflow": frozenset(n for n in BACKWARD_NAMES if n != "cudnn")}
    allowed.update({name: {name} for name in BACKWARD_NAMES})
    return want, None if allowed[want] is None else frozenset(allowed[want])


def ours_faster_at(cap: tuple[int, int], H: int, d_qk: int, K: int, S: int) -> bool:
    """Whether an `OURS_FASTER` row covers this shape on this GPU generation."""
    return any(r[:4] == (cap[0], H, d_qk, K) and r[4] <= S <= r[5] for r in OURS_FASTER)


# ---- the capability rules: (q, kv, indices, d_v, needs) -> None or the reason ----


def _cudnn_rule(q, kv, indices, d_v, needs: BackwardNeeds) -> str | None:
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
    if forced_backward()[0] == "auto" and ours_faster_at(cap, H, d_qk, indices.shape[-1], kv.shape[1]):
        return f"dsaflow's backward measured faster at H={H}, d_qk={d_qk}, K={indices.shape[-1]}, S={kv.shape[1]}"
    return None


def _hopper_rule(q, kv, indices, d_v, needs: BackwardNeeds) -> str | None:
    return hopper_bwd_supports(q, kv, indices, d_v)  # its dq and dkv kernels are `triton`'s: every need is met


def _triton_rule(q, kv, indices, d_v, needs: BackwardNeeds) -> str | None:
    return None  # it takes every call the forward kernels take


BACKWARDS = (("cudnn", _cudnn_rule), ("hopper", _hopper_rule), ("triton", _triton_rule))
BACKWARD_NAMES = tuple(name for name, _ in BACKWARDS)
# The backwards that return no attention probabilities: with `probs_into`, `triton_probs.py` adds the target after.
TARGET_PASS_AFTER = frozenset({"cudnn"})


def explain_sparse_mla_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    d_v: int,
    lse_grad: bool = False,
    probs_into: bool = False,
    deterministic: bool | None = None,
) -> Choice:
    """Which backward a differentiable `sparse_mla(q, kv, indices, ..., d_v)` call runs, and why each earlier
    candidate was refused; deterministic defaults to `is_deterministic()` now. Runs nothing, logs nothing. With
    probs_into, `cudnn` means cuDNN-Frontend's dq and dkv, then the target from `triton_probs.py`'s Q.K^T pass.

        >>> print(explain_sparse_mla_backward(q, kv, idx, 512))
        runs triton (refused: cudnn: cuDNN-Frontend is not installed (...); pip install 'dsaflow[peers]' ...)"""
    det = is_deterministic() if deterministic is None else deterministic
    setting, allowed = forced_backward()
    needs = BackwardNeeds(lse_grad, probs_into, det)
    return walk(BACKWARDS, q, kv, indices, d_v, needs, allowed=allowed, excluded_by=f"{ENV_BACKWARD}={setting}")


def check_forced_backward() -> None:
    """Raise at the forward, not after it, when `DSAFLOW_SPARSE_MLA_BACKWARD=cudnn` and cuDNN-Frontend is missing."""
    if forced_backward()[0] == "cudnn" and (missing := cb.cudnn_import_error()) is not None:
        raise PlanError(f"{ENV_BACKWARD}=cudnn: {missing}; or set {ENV_BACKWARD}=auto.")


_LOGGED: set[str] = set()


def backward_label(kernel: str, needs: BackwardNeeds) -> str:
    """What runs for the target too: "cudnn + target pass (triton_probs)" where one of `TARGET_PASS_AFTER` runs
    with `probs_into`, else the backward's name."""
    return f"{kernel} + target pass (triton_probs)" if needs.probs_into and kernel in TARGET_PASS_AFTER else kernel


def choose_backward(q, kv, indices, d_v: int, needs: BackwardNeeds) -> Choice:
    """The table's choice for a backward call, logged the first time each backward (`backward_label`) runs in this
    process. Raises PlanError when none takes it (only possible when forced)."""
    setting, allowed = forced_backward()
    choice = walk(BACKWARDS, q, kv, indices, d_v, needs, allowed=allowed, excluded_by=f"{ENV_BACKWARD}={setting}")
    if choice.kernel is None:
        raise PlanError(
            f"{ENV_BACKWARD}={setting}, but that backward does not take q {tuple(q.shape)} {q.dtype}, kv "
            f"{tuple(kv.shape)}, d_v={d_v}, {needs}: {choice.reasons()}. Set {ENV_BACKWARD}=auto to let the "
            "dispatch rule pick per call."
        )
    label = backward_label(choice.kernel, needs)
    if label not in _LOGGED:
        _LOGGED.add(label)
        version = cb.cudnn_version() if choice.kernel == "cudnn" else None
        version = f" {version}" if version else ""
        log.info("sparse_mla backward: %s%s (%s=%s; %s)", label, version, ENV_BACKWARD, setting, choice)
    return choice


def sparse_mla_backward(q, kv, indices, out, lse, d_out, d_lse, sm_scale: float, d_v: int, n_keys, probs_into):
    """dq, dkv of one `SparseMLAFunction` call by the backward the table picks (`sparse_mla_bwd_triton`'s shapes;
    d_lse None when lse receives no gradient); probs_into = (target, weight) gets the indexer-loss target added."""
    needs = BackwardNeeds(d_lse is not None, probs_into is not None, is_deterministic())
    kernel = choose_backward(q, kv, indices, d_v, needs).kernel
    if kernel == "cudnn":
        dq, dkv = cb.sparse_mla_bwd_cudnn(q, kv, indices, out, lse, d_out, sm_scale, d_v, n_keys, needs.deterministic)
    else:  # dsaflow's backward adds the target from the P of its pass 1
        args = q, kv, indices, out, lse, d_out, d_lse, sm_scale, d_v
        dq, dkv = sparse_mla_bwd_triton(
            *args, deterministic=needs.deterministic, n_keys=n_keys, probs_into=probs_into, pass1=kernel
        )
    if probs_into is not None and kernel in TARGET_PASS_AFTER:
        sparse_mla_probs_triton(q, kv, indices, lse, sm_scale, d_v, probs_into, n_keys=n_keys)
    return dq, dkv
