"""Point-to-point moves between pipeline ranks (serving, forward-only training passes), outside any CUDA graph.

Each tick's moves are posted together (on NCCL in one coalescing block of the process group, elsewhere with
`dist.batch_isend_irecv`) and waited: with NCCL the wait only orders the current stream after
the transfer (no host sync), so a decode step never blocks the host. Received tensors land in persistent buffers
(one per shape/dtype/peer) that the caller consumes (copies into a graph's static input or feeds an eager forward)
before the next receive; NCCL orders the next receive after those consumers on the current stream.

NCCL note: a communicator's first P2P call must not be a batch of P2P ops posted by only some ranks, so `warm_up`
runs one collective over the whole group first.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class StageLink:
    """Send/recv of activations and token ids between ranks. `device` is where buffers live (cuda for NCCL).

    coalesce: post a tick's ops on the default process group inside one coalescing block of its own (one NCCL
    group launch) instead of through `dist.batch_isend_irecv`, whose per-op Python checks cost the host a third
    more per tick (53-67 against 82-100 us on an H100, `scripts/bench_serve.py p2p`). Default: where the backend
    coalesces (NCCL); gloo posts op by op either way."""

    def __init__(self, device: torch.device | str, coalesce: Optional[bool] = None):
        self.device = torch.device(device)
        self._buffers: Dict[Tuple[Tuple[int, ...], torch.dtype, int], torch.Tensor] = {}
        self._group = None
        if coalesce is None:
            coalesce = dist.is_initialized() and dist.group.WORLD._get_backend(self.device).supports_coalescing
        if coalesce:
            self._group = dist.distributed_c10d._get_default_group()

    def warm_up(self) -> None:
        """One small all_reduce so every rank has joined the communicator before the first P2P batch."""
        probe = torch.ones(1, device=self.device)
        dist.all_reduce(probe)
        if int(probe.item()) != dist.get_world_size():  # a host sync here is fine: setup, not a step
            raise RuntimeError(f"process group warm-up saw {probe.item()} ranks, expected {dist.get_world_size()}")

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst` (made contiguous; the peer must post a matching recv of the same shape)."""
        tensor = tensor.contiguous()
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)]):
            req.wait()

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of `shape`/`dtype` from rank `src` into a reused buffer (valid until the next recv of the
        same shape from the same peer)."""
        key = (tuple(int(s) for s in shape), dtype, src)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(key[0], dtype=dtype, device=self.device)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, src)]):
            req.wait()
        return buf

    def all_ranks_max(self, flag: torch.Tensor) -> torch.Tensor:
        """Max of a small tensor over all ranks (used for the optional EOS stop, once per step)."""
        flag = flag.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def exchange(self, ops) -> None:
        """ops: [("send" | "recv", tensor, global rank)] of one pipeline tick, posted together (one coalescing
        block, else one `batch_isend_irecv`: sends and receives in flight at once, so a ring of sends cannot
        deadlock) and waited.
        Receive tensors are filled in place. With NCCL the wait orders the current stream only (no host sync)."""
        if self._group is not None:
            group = self._group
            group._start_coalescing(self.device)
            for kind, tensor, peer in ops:  # the default group: its ranks are the global ranks
                (group.send if kind == "send" else group.recv)([tensor], peer, 0)
            group._end_coalescing(self.device).wait()
            return
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer) for kind, tensor, peer in ops]
        for req in dist.batch_isend_irecv(p2p):
            req.wait()


def post_tick(link, ops: Sequence[Tuple[str, object, int]], device) -> List[torch.Tensor]:
    """One tick's ops, [("send", tensor, peer, declared shape) | ("recv", (shape, dtype), peer)] in posting order
    (`PipelineSchedule.transfers`), posted eagerly on `link` (a send shorter than its declared shape is padded with
    zeros; `TransferGraphs` replays the same ops from CUDA graphs) -> the received tensors, in order."""
    posted, received = [], []
    for op in ops:
        kind, what, peer = op[0], op[1], op[2]
        if kind == "send":
            shape = tuple(op[3])
            if tuple(what.shape) != shape:
                padded = what.new_zeros(shape)
                padded.narrow(0, 0, what.shape[0]).copy_(what)
                what = padded
            posted.append(("send", what.contiguous(), peer))
        else:
            buf = torch.empty(what[0], dtype=what[1], device=device)
            received.append(buf)
            posted.append(("recv", buf, peer))
    link.exchange(posted)
    return received


@contextmanager
def torchrun_rank(device_type: str, threads: Optional[int] = None) -> Iterator[Tuple[torch.device, StageLink]]:
    """Join torchrun's process group as this process's rank and yield `(device, link)`, the link warmed up.

    `device_type` "cuda": NCCL on the LOCAL_RANK GPU; "cpu": gloo, with `threads` intra-op threads when given.
    On success every rank meets at a barrier before the group is destroyed (see `leave_together`).
    """
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        if threads is not None:
            torch.set_num_threads(threads)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    with leave_together():
        link = StageLink(device)
        link.warm_up()
        yield device, link


_graph_holders: List[weakref.ref] = []


def release_before_teardown(holder) -> None:
    """Have `holder.release()` run before this process destroys its process group (`leave_together`).

    For objects that keep CUDA graphs which captured NCCL transfers: destroying the group while such a graph is
    alive hangs (seen with torch 2.11 on H200s; pytorch/pytorch#115388 is the upstream report). Held weakly: a
    holder that is gone by then is skipped."""
    _graph_holders.append(weakref.ref(holder))


def _release_graph_holders() -> None:
    while _graph_holders:
        holder = _graph_holders.pop()()
        if holder is not None:
            holder.release()


@contextmanager
def leave_together(group=None) -> Iterator[None]:
    """Run the body, then barrier on `group` and destroy the default process group.

    A gloo rank that destroys its group and exits while a peer still reads its last collective or P2P message can
    make that peer fail ("Connection closed by peer") or abort at exit, at random. The barrier runs only on success:
    after an error a peer may never reach it. Holders registered with `release_before_teardown` release their
    graphs after the barrier (on NCCL it waits for the work already queued) and before the group goes.
    """
    try:
        yield
        dist.barrier(group=group)
    finally:
        _release_graph_holders()
        dist.destroy_process_group()
