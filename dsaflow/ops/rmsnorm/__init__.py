"""RMSNorm.

Layout: `naive.py` (fp32 reference), the kernels (`triton_rmsnorm.py`: forward, backward with a deterministic weight
gradient), the autograd.Function (`function.py`), the dispatch table (`dispatch.py`, `explain_rms_norm`), and the
public `rms_norm` below.
"""

from __future__ import annotations

import torch

from ..kernel_table import chosen, describe
from .dispatch import explain_rms_norm
from .naive import rms_norm_naive


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32.

    Args:
        x: [..., D] (bf16/fp16/fp32 on CUDA; rows may be strided, e.g. a slice of a wider tensor).
        weight: [D].
        eps: added to the mean square.

    Returns:
        [..., D] in x.dtype. Differentiable in x and weight. The kernel is chosen by `dispatch.py`
        (`explain_rms_norm(...)`); a CUDA input no kernel takes raises ValueError.
    """
    if chosen("rms_norm", explain_rms_norm(x, weight), describe(x=x, weight=weight)) == "reference":
        return rms_norm_naive(x, weight, eps)
    from .function import rms_norm_triton

    return rms_norm_triton(x, weight, eps)


__all__ = ["explain_rms_norm", "rms_norm", "rms_norm_naive"]
