"""What `train.device=auto` means on this machine, decided without importing torch where no GPU can be present.

The parent process of `dsaflow train` / `generate` checks a run before it launches anything; importing torch there
costs about 2 s on a small CPU machine, and it only needs torch to count GPUs. Without a GPU driver (neither NVIDIA's
management library nor ROCm's /dev/kfd) torch sees no GPU either, so the answer is `cpu` at once; with one, torch is
asked (it knows CUDA_VISIBLE_DEVICES, CPU-only builds and broken drivers).
"""

from __future__ import annotations

import ctypes
import os


def gpu_driver_present() -> bool:
    """Whether a GPU driver that torch could use is installed: libnvidia-ml loads, or /dev/kfd (ROCm) exists."""
    if os.path.exists("/dev/kfd"):
        return True
    for lib in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
        try:
            ctypes.CDLL(lib)
            return True
        except OSError:
            continue
    return False


def resolve_device_type(train_device: str) -> str:
    """train.device auto -> cuda when a GPU is visible, else cpu; any other value is returned as it is."""
    if train_device != "auto":
        return train_device
    if not gpu_driver_present():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
