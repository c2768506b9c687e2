"""What the op tests share: a CPU tensor that the dispatch rules read as a CUDA one, and `sparse_mla` through its
kernels on any device (CPU tensors run the Triton kernels in the interpreter)."""

from __future__ import annotations

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
