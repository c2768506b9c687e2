"""YaRN RoPE scaling (DeepSeek-V3 / V3.2), as `model.rope_scaling`; None = plain RoPE with `model.rope_theta`.

YaRN stretches the low frequencies of RoPE by `factor` (positions beyond `original_max_position_embeddings`
interpolate), keeps the high ones (they extrapolate), with a linear ramp between the dimensions that make
`beta_fast` and `beta_slow` turns over the original context. Two scalars follow from the fields:
- `rope_attention_factor`: multiplies cos and sin (so the rotated slice of q and k);
- `softmax_mscale`: multiplies the attention's softmax scale (squared mscale of `mscale_all_dim`).
Field names and defaults follow Hugging Face's `rope_parameters` of `rope_type: yarn`, so that a config.json maps as
it is; the frequencies themselves are `dsaflow.model.rope`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .fields import num


@dataclass
class YarnConfig:
    """DeepSeek-V3.2 ships factor 40, original 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1."""

    factor: float = num(1.0, 1, 1e6)
    original_max_position_embeddings: int = num(4096, 1, 1 << 24)
    beta_fast: float = num(32.0, 0, 1e6, lo_open=True)
    beta_slow: float = num(1.0, 0, 1e6, lo_open=True)
    mscale: Optional[float] = num(None, 0, 1e6)
    mscale_all_dim: Optional[float] = num(None, 0, 1e6)
    attention_factor: Optional[float] = num(None, 0, 1e6, lo_open=True)  # explicit cos/sin factor (wins)
    truncate: bool = True  # round the ramp's ends to whole dimensions


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(yarn: Optional[YarnConfig]) -> float:
    """The factor on cos and sin (1 without YaRN, and 1 for DeepSeek-V3.2's mscale == mscale_all_dim)."""
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return _mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim)
    return _mscale(yarn.factor)


def softmax_mscale(yarn: Optional[YarnConfig]) -> float:
    """The factor on MLA's softmax scale (N + R)^-0.5: mscale(factor, mscale_all_dim)^2, 1 without it."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    return _mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def yarn_ramp_range(yarn: YarnConfig, dim: int, theta: float) -> tuple[float, float]:
    """The first and last rotary pair index (of dim // 2) of the ramp between extrapolated and interpolated."""

    def turns_dim(turns: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(yarn.beta_fast), turns_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
