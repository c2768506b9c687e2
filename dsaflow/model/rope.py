"""Rotary position embedding, half-split (GPT-NeoX) convention.

A rotary vector of `d` dims is split into halves x = [x1 | x2] and rotated pairwise (x1[i], x2[i]) by angle
pos * theta^(-2i/d): out = [x1 cos - x2 sin | x2 cos + x1 sin]. MLA applies it to the whole `qk_rope_head_dim`
part of q and k; the indexer to the first `index_rope_head_dim` dims of its q and k.

With `model.rope_scaling` (YaRN, dsaflow/config/rope_schema.py) the frequencies blend theta^(-2i/d) (extrapolation, the
fast pairs) and theta^(-2i/d) / factor (interpolation, the slow pairs) along a linear ramp, and cos and sin carry
the YaRN attention factor. Checkpoints whose rotary pairs are interleaved, (x[2i], x[2i+1]), map to this layout by
permuting their projection rows at load (dsaflow/checkpoint/hf_names.py): the dot products are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dsaflow.config.rope_schema import YarnConfig, rope_attention_factor, yarn_ramp_range
from dsaflow.ops.rope import rope

_INV_FREQ: dict = {}  # (dim, theta, device, yarn fields) -> the frequencies [dim // 2], fp32 on the device
_TABLES: dict = {}  # (mla dim, index dim, theta, yarn fields) -> its `RopeTables`


def inv_freq(dim: int, theta: float, yarn: Optional[YarnConfig] = None, device=None) -> torch.Tensor:
    """The rotary frequencies [dim // 2] fp32: theta^(-2i/dim), blended with theta^(-2i/dim) / factor under YaRN."""
    plain = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if yarn is None:
        return plain
    low, high = yarn_ramp_range(yarn, dim, theta)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return plain / yarn.factor * ramp + plain * (1 - ramp)


def _inv_freq(dim: int, theta: float, device: torch.device, yarn: Optional[YarnConfig]) -> torch.Tensor:
    """The frequencies, computed once per (dim, theta, device, yarn): four fewer small kernels and their launches in
    every forward. Not kept when first made inside a CUDA-graph capture (its memory belongs to the graph's pool)."""
    key = (dim, float(theta), str(device), None if yarn is None else dataclasses.astuple(yarn))
    freq = _INV_FREQ.get(key)
    if freq is None:
        freq = inv_freq(dim, theta, yarn, device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _INV_FREQ[key] = freq
    return freq


def _angles(positions: torch.Tensor, freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] int, freq [dim // 2] -> (cos, sin) each [B, T, dim // 2] fp32, times `factor` (YaRN)."""
    ang = positions.clamp(min=0).float().unsqueeze(-1) * freq
    if factor != 1.0:
        return ang.cos() * factor, ang.sin() * factor
    return ang.cos(), ang.sin()


def rope_angles(
    positions: torch.Tensor, dim: int, theta: float, yarn: Optional[YarnConfig] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] int -> (cos, sin) each [B, T, dim // 2] fp32. Negative (padding) positions use 0."""
    return _angles(positions, _inv_freq(dim, theta, positions.device, yarn), rope_attention_factor(yarn))


class RopeTables:
    """The rotary tables of one model config (`model.qk_rope_head_dim`, `index_rope_head_dim`, `rope_theta`,
    `rope_scaling`). Its constants are computed when it is built (the YaRN attention factor) or on first use per
    device (the frequencies), so a forward only turns its positions into angles. StageModule keeps `of(cfg)`."""

    def __init__(self, mla_dim: int, index_dim: int, theta: float, yarn: Optional[YarnConfig] = None):
        self.mla_dim, self.index_dim, self.theta, self.yarn = mla_dim, index_dim, theta, yarn
        self.factor = rope_attention_factor(yarn)
        self._freq: dict = {}  # (dim, device) -> `inv_freq` [dim // 2] fp32 on that device

    @classmethod
    def of(cls, model_cfg) -> RopeTables:
        """The tables of a `ModelConfig`, one instance per distinct rotary config: every stage of a model shares
        its frequencies, so a stage first run inside a CUDA-graph capture finds them made by an earlier one."""
        c = model_cfg
        yarn = c.rope_scaling
        key = (c.qk_rope_head_dim, c.index_rope_head_dim, float(c.rope_theta), yarn and dataclasses.astuple(yarn))
        if key not in _TABLES:
            _TABLES[key] = cls(c.qk_rope_head_dim, c.index_rope_head_dim, c.rope_theta, yarn)
        return _TABLES[key]

    def _frequencies(self, dim: int, device: torch.device) -> torch.Tensor:
        """Not kept when first made inside a CUDA-graph capture (its memory belongs to the graph's pool)."""
        freq = self._freq.get((dim, device))
        if freq is None:
            freq = inv_freq(dim, self.theta, self.yarn, device)
            if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._freq[(dim, device)] = freq
        return freq

    def __call__(self, positions: torch.Tensor):
        """positions [B, T] int -> (MLA (cos, sin), indexer (cos, sin)), each [B, T, rotary dim // 2] fp32, as
        `rope_angles` computes them; one pair when the two rotary dims agree (64 and 64 at V3.2's dims). Read-only:
        the layers slice them, never write them."""
        mla = _angles(positions, self._frequencies(self.mla_dim, positions.device), self.factor)
        if self.index_dim == self.mla_dim:
            return mla, mla
        return mla, _angles(positions, self._frequencies(self.index_dim, positions.device), self.factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, d] or [B, T, H, d]; cos/sin [B, T, d // 2] -> rotated x, same shape and dtype (math in fp32).
    CUDA tensors run the Triton kernel, CPU tensors the torch reference (`dsaflow.ops.rope`)."""
    return rope(x, cos, sin)


def apply_rope_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate only the first `rope_dim` dims of x [..., d] (the indexer convention); the rest pass through."""
    return rope(x, cos, sin, rope_dim)
