"""Process-wide switch for a deterministic sparse-MLA backward.

The default backward adds each query's dkv contribution with fp32 atomics: rows selected by many queries are summed
in whatever order the GPU schedules them, so two runs on the same inputs can differ in the last bits of dkv. In
deterministic mode the contributions are stored per (query, slot) and each key row sums its own in a fixed order
(query, then slot), so dq and dkv are bit-identical across runs on the same inputs, device and software. It costs
an fp32 buffer of K * d_qk * 4 bytes per query in a chunk (up to 2 GiB by default) and some speed (docs/kernels.md).

    from dsaflow.ops.sparse_mla import set_deterministic, deterministic
    set_deterministic(True)          # once per process (e.g. in the trainer), or
    with deterministic():            # for a block; the flag is read when backward runs
        loss.backward()

`torch.use_deterministic_algorithms(True)` turns it on as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_DETERMINISTIC = False


def set_deterministic(on: bool = True) -> None:
    """Turn the deterministic sparse-MLA backward on or off for this process."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(on)


def is_deterministic() -> bool:
    """True if the switch is on or torch's deterministic-algorithms mode is."""
    return _DETERMINISTIC or torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def deterministic(on: bool = True) -> Iterator[None]:
    """Set the switch inside a block and restore the previous value after it."""
    global _DETERMINISTIC
    prev = _DETERMINISTIC
    _DETERMINISTIC = bool(on)
    try:
        yield
    finally:
        _DETERMINISTIC = prev
