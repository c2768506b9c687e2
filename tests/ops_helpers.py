"""What the op tests share: a CPU tensor that the dispatch rules read as a CUDA one, and `sparse_mla` through its
kernels on any device (CPU tensors run the Triton kernels in the interpreter)."""

from __future__ import annotations

import contextlib

import torch


class FakeCuda:
    """A CPU tensor that reads as a CUDA one to a dispatch rule (rules read shapes, dtypes, strides and the device,
    never values), so the CPU tests can walk each op's table as a CUDA call would."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __getattr__(self, name):
        return getattr(self._tensor, name)


@contextlib.contextmanager
def sparse_mla_kernels_only():
    """Inside the block, `sparse_mla`'s table has no CPU reference row: CPU tensors walk the kernels' rows as CUDA
    ones do, and run the Triton kernels in the interpreter."""
    from dsaflow.ops.sparse_mla import dispatch

    table = dispatch.KERNELS
    dispatch.KERNELS = tuple(row for row in table if row[0] != "reference")
    try:
        yield
    finally:
        dispatch.KERNELS = table


def sparse_mla_kernels(q, kv, indices, sm_scale: float, d_v: int, probs_into=None):
    """`sparse_mla` through its kernels on any device (`sparse_mla_kernels_only`)."""
    from dsaflow.ops.sparse_mla import sparse_mla

    with sparse_mla_kernels_only():
        return sparse_mla(q, kv, indices, sm_scale, d_v, probs_into)
