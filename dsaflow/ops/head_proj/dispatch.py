"""Which kernel runs a head projection: one table of (kernel, capability rule), walked by `explain_head_proj`.

| kernel        | runs when                                                                                  |
|---------------|--------------------------------------------------------------------------------------------|
| `strided_bmm` | every device: the activation and the weight share a dtype (cast the weight first) and their |
|               | shapes match (`absorb_query`: q [B, T, H, N + R] with R > 0, w_uk [H, N, C]; `head_output`:  |
|               | o_lat [B, T, H, C], w_uv [H, V, C])                                                         |

`strided_bmm` is `function.py`: torch.bmm over heads through strided views, on CPU and CUDA alike (the rotation
inside `absorb_query` follows `dsaflow.ops.rope`'s own dispatch). A call it refuses raises ValueError.
"""

from __future__ import annotations

import torch

from ..kernel_table import Choice, walk

OPS = ("absorb_query", "head_output")


def _strided_bmm_rule(op: str, x: torch.Tensor, w: torch.Tensor) -> str | None:
    if x.dtype != w.dtype:
        return (
            f"activation dtype {x.dtype} != weight dtype {w.dtype} (cast the weight to the compute dtype before "
            f"the call)"
        )
    if op == "absorb_query" and (x.dim() != 4 or w.dim() != 3 or x.shape[2] != w.shape[0] or x.shape[3] <= w.shape[1]):
        return f"q {tuple(x.shape)} with w_uk {tuple(w.shape)} (expected [B, T, H, N + R] with R > 0 and [H, N, C])"
    if op == "head_output" and (x.dim() != 4 or w.dim() != 3 or x.shape[2] != w.shape[0] or x.shape[3] != w.shape[2]):
        return f"o_lat {tuple(x.shape)} with w_uv {tuple(w.shape)} (expected [B, T, H, C] and [H, V, C])"
    return None


KERNELS = (("strided_bmm", _strided_bmm_rule),)


def explain_head_proj(op: str, x: torch.Tensor, w: torch.Tensor) -> Choice:
    """Which kernel `absorb_query(x, w, ...)` (op "absorb_query") or `head_output(x, w)` (op "head_output") runs,
    and why each earlier one was refused. Runs nothing."""
    if op not in OPS:
        raise ValueError(f"explain_head_proj: op {op!r}, expected one of {OPS}")
    return walk(KERNELS, op, x, w)
