"""A tick's point-to-point transfers replayed from CUDA graphs (`graphs.transfers`), one graph per signature.

Posting a tick's sends and receives to NCCL costs a rank's host 50-130 us per tick in Python and the process group's
C++ (one coalescing block; docs/serving.md, "Host work per tick"), as much as a thin stage's decode pass. Replaying
the same transfers from a CUDA graph costs 6-8 us (`scripts/bench_serve.py p2p`, graph mode). Here each distinct
*signature* of a tick's transfers, the ordered list of (send | recv, shape, dtype, peer), is captured once into a
graph over static buffers, the first time it occurs, and replayed whenever it recurs:

- a send's tensor is copied into the graph's static send buffer (its first rows when it has fewer rows than the
  declared shape, which the serving engine pads to a shape class so that signatures recur);
- a receive lands in the graph's static receive buffer, which the caller reads before the same signature's next
  replay: every consumer is a kernel enqueued on the current stream before the next tick's transfers, so stream
  order keeps the buffer intact until it is read.

A capture records the transfers without running them, and the replay that follows runs them: the peers see the same
operations in the same order as eager posting, whether they replay, capture or post eagerly. Capture runs on a side
stream without a device synchronise (a new signature mid-run costs its capture, not a drain of the queue). A capture
that fails raises: replaying some ticks and posting others eagerly on one rank is fine, but a rank that cannot
capture should not hide it. The graphs are released before the process group is destroyed (`p2p.leave_together`):
a live graph that captured NCCL transfers makes that teardown hang.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dsaflow.pipeline.capture_guard import gc_paused
from dsaflow.pipeline.p2p import post_tick, release_before_teardown

Signature = Tuple[Tuple[str, Tuple[int, ...], torch.dtype, int], ...]


class CudaTransferCapturer:
    """Captures a callable as a CUDA graph on `device`, on a side stream and without warm-up calls (a warm-up would
    post the transfers once more than the peers expect). -> an object with `.replay()`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(device=self.device)
            self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], None]):
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the static buffers were filled on the current stream
        with torch.cuda.stream(self.stream):
            # thread_local: the process group's watchdog thread may query its events while this thread captures
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        return graph


class TransferGraphs:
    """link: the `StageLink` whose `exchange(ops)` posts one tick's transfers; capturer(fn) -> object with
    `.replay()` that runs fn's transfers (default: `CudaTransferCapturer` on `device`); max_graphs: the most signatures
    captured (a run whose transfers keep changing shape would otherwise capture without end; beyond it, ticks post
    eagerly and `eager_ticks` counts them)."""

    def __init__(self, link, device, capturer: Optional[Callable] = None, max_graphs: int = 512):
        self.link, self.device, self.max_graphs = link, torch.device(device), int(max_graphs)
        if capturer is None and self.device.type != "cuda":
            raise ValueError(f"graphs.transfers captures CUDA graphs; this rank runs on {self.device}.")
        self.capturer = capturer or CudaTransferCapturer(self.device)
        self.graphs: Dict[Signature, Tuple[object, List[torch.Tensor]]] = {}
        self.captures = self.replays = self.eager_ticks = 0
        self.released = False
        release_before_teardown(self)

    def __call__(self, ops: Sequence[Tuple[str, object, int]]) -> List[torch.Tensor]:
        """ops: one tick's [("send", tensor, peer, shape) | ("recv", (shape, dtype), peer)] in posting order, where a
        send's declared `shape` may have more rows than its tensor -> the received tensors, in order."""
        if self.released:
            raise RuntimeError("TransferGraphs used after release(): the process group is being torn down")
        signature = signature_of(ops)
        entry = self.graphs.get(signature)
        if entry is None and len(self.graphs) >= self.max_graphs:
            self.eager_ticks += 1
            return post_tick(self.link, ops, self.device)
        if entry is None:
            entry = self.graphs[signature] = self._capture(signature)
        graph, buffers = entry
        for op, buf in zip(ops, buffers):
            if op[0] == "send":
                buf.narrow(0, 0, op[1].shape[0]).copy_(op[1])
        graph.replay()
        self.replays += 1
        return [buf for op, buf in zip(ops, buffers) if op[0] == "recv"]

    def release(self) -> None:
        """Free every captured graph (called before the process group is destroyed); later calls raise."""
        for graph, _ in self.graphs.values():
            reset = getattr(graph, "reset", None)
            if reset is not None:
                reset()
        self.graphs.clear()
        self.released = True

    def _capture(self, signature: Signature):
        buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _, shape, dtype, _ in signature]
        static_ops = [(kind, buf, peer) for (kind, _, _, peer), buf in zip(signature, buffers)]
        with gc_paused():  # a collection mid-capture may free a dead graph, which fails the capture
            graph = self.capturer(lambda: self.link.exchange(static_ops))
        self.captures += 1
        return graph, buffers


def signature_of(ops) -> Signature:
    """The ordered (kind, shape, dtype, peer) of a tick's ops: sends by their declared shape."""
    return tuple(
        ("send", tuple(op[3]), op[1].dtype, op[2]) if op[0] == "send" else ("recv", tuple(op[1][0]), op[1][1], op[2])
        for op in ops
    )
