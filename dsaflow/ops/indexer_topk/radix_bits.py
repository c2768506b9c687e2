"""Order-preserving bits of fp32 scores and the radix-digit step of the select kernels (`triton_select`): a score's
ordered int32 sorts like the float, so an exact top-k can be found a byte at a time."""

from __future__ import annotations

import triton
import triton.language as tl

SIGN = tl.constexpr(-2147483648)  # 0x80000000 as int32
NEG_INF_ORDERED = tl.constexpr(-2139095041)  # the order-preserving int32 of -inf
INT32_MIN = tl.constexpr(-2147483648)
INT64_MIN = tl.constexpr(-9223372036854775808)


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _threshold_bucket(hist, need, NB: tl.constexpr):
    """hist [NB] counts of one radix digit; need >= 1 <= sum(hist). -> (bucket b holding the need-th largest,
    count in buckets above b, count in b)."""
    bins = tl.arange(0, NB)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # count strictly above each bucket
    hit = (above < need) & (above + hist >= need)
    b = tl.max(tl.where(hit, bins, -1), 0)
    gt = tl.sum(tl.where(bins > b, hist, 0), 0)
    eq = tl.sum(tl.where(bins == b, hist, 0), 0)
    return b, gt, eq
