"""What every CUDA graph capture in dsaflow runs under: Python's cyclic garbage collector paused.

A collection that runs while a stream captures may free a CUDA graph that is already dead but still held by a
reference cycle (an engine dropped earlier in the same process: a benchmark's previous configuration, a test's
previous engine). Destroying a graph is not permitted while a stream captures: torch's destructor only warns
("operation not permitted when stream is capturing"), and the capture in flight fails. On a pipeline rank that failure
leaves its peers waiting in their transfers. torch.cuda.graph no longer collects before a capture by default
(torch.compiler.config.force_cudagraph_gc), so nothing else keeps collections out of a capture.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector's previous state comes back after it, on error too.
    (Garbage made meanwhile is collected at the next collection after the block.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
