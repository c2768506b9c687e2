"""`quantize_once`: the FP8 GEMMs inside the block that read one activation share one quantization of it, which is
dropped when the activation is written in place and when the block exits (CPU: the bookkeeping, with a counting
stand-in for the quantization kernel; the kernels themselves in test_fp8_gemm_gpu.py)."""

from __future__ import annotations

import gc
import weakref

import torch

from dsaflow.ops.fp8_gemm import quantize_once, quantize_rows_1x128
from dsaflow.ops.fp8_gemm.shared_input import SHARED_PAD_ROWS, shared_quantization


class CountingQuantizer:
    def __init__(self):
        self.calls = []

    def __call__(self, x2, ue8m0, pad_rows):
        self.calls.append((x2.data_ptr(), ue8m0, pad_rows))
        x8, scale = quantize_rows_1x128(x2, ue8m0)
        return x8, scale.t().contiguous()


def rows(x):
    return x.reshape(-1, x.shape[-1])


def test_outside_a_block_nothing_is_shared():
    q = CountingQuantizer()
    x = torch.randn(6, 256)
    assert shared_quantization(x, False, 1, q) is None
    assert q.calls == []


def test_one_quantization_per_activation_and_format_inside_the_block():
    q = CountingQuantizer()
    x, other = torch.randn(2, 3, 256), torch.randn(6, 256)
    with quantize_once(x):
        first = shared_quantization(rows(x), False, 1, q)
        again = shared_quantization(x.view(6, 256), False, SHARED_PAD_ROWS, q)  # another view, the same rows
        assert again is first and len(q.calls) == 1 and q.calls[0][2] == SHARED_PAD_ROWS
        assert shared_quantization(other, False, 1, q) is None  # not shared: its GEMM quantizes it itself
        assert shared_quantization(x[:, :2].reshape(-1, 256), False, 1, q) is None  # other rows of x
        assert shared_quantization(rows(x), False, 3, q) is None  # a padding the shared copy does not meet
        power_of_two = shared_quantization(rows(x), True, 1, q)
        assert len(q.calls) == 2 and power_of_two is not first
        ref8, ref_scale = quantize_rows_1x128(rows(x))
        assert torch.equal(first[0].view(torch.uint8), ref8.view(torch.uint8))
        assert torch.equal(first[1], ref_scale.t())
    assert shared_quantization(rows(x), False, 1, q) is None and len(q.calls) == 2


def test_an_in_place_write_makes_the_next_gemm_quantize_afresh():
    q = CountingQuantizer()
    x = torch.randn(4, 384)
    with quantize_once(x):
        before = shared_quantization(x, False, 1, q)
        x.mul_(2)
        after = shared_quantization(x, False, 1, q)
        assert len(q.calls) == 2 and not torch.equal(before[1], after[1])
        assert torch.equal(after[1], quantize_rows_1x128(x)[1].t())
        assert shared_quantization(x, False, 1, q) is after and len(q.calls) == 2


def test_blocks_nest_and_let_go_of_their_activations():
    q = CountingQuantizer()
    outer, inner = torch.randn(4, 128), torch.randn(4, 128)
    with quantize_once(outer):
        shared = shared_quantization(outer, False, 1, q)
        with quantize_once(inner):
            assert shared_quantization(outer, False, 1, q) is shared  # the outer block's entry, seen from inside
            assert shared_quantization(inner, False, 1, q) is not None
        assert shared_quantization(inner, False, 1, q) is None and shared_quantization(outer, False, 1, q) is shared
    assert len(q.calls) == 2
    alive = weakref.ref(inner)
    del inner
    gc.collect()
    assert alive() is None  # nothing kept past the block
