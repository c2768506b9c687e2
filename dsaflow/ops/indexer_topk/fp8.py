"""FP8 (e4m3) rows for the indexer logits, as DeepSeek-V3.2 runs its lightning indexer.

Each row of D values (one query head, or one key) gets its own scale amax / 448, so x ~= x8 * scale with e4m3's
3-bit mantissa (relative error <= 2^-4 per element). The logits stay exact in the scales: a scale is positive, so
relu(s_q s_k x) = s_q s_k relu(x), and I[t, s] = s_k[s] * sum_h (w[t, h] s_q[t, h]) relu(q8[t, h] . k8[s]). The
kernel folds s_q into w and multiplies s_k once per key after the head sum.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (x8 float8_e4m3fn [..., D], scale fp32 [...]) with x ~= x8 * scale[..., None].

    A row of zeros gets scale 1 (and stays zeros)."""
    xf = x.detach().float()
    amax = xf.abs().amax(dim=-1)
    # times the fp32 reciprocal, not a division: what torch's CUDA division by a scalar computes, and the kernel too
    scale = torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))
    return (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_rows(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values the fp8 logits compute with: x8 [..., D], scale [...] -> fp32 [..., D]."""
    return x8.float() * scale.unsqueeze(-1)


def fp8_reason(q: torch.Tensor) -> str | None:
    """None if q's CUDA device has fp8 tensor cores (compute capability 8.9+), else the user-facing reason."""
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) >= (8, 9):
        return None
    return (
        f"model.index_fp8=true needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper and later); "
        f"{torch.cuda.get_device_name(q.device)} is sm_{major}{minor}. Set model.index_fp8=false"
    )
