"""The EOS flags of each pass (serve.eos_id), read one pass of its group late, so that no host waits on its GPU.

Which rows sampled EOS is the one data-dependent fact of the schedule. Read as each pass arrives, it made every
rank's host wait for its GPU every tick, and the GPU then ran dry while the host built the next tick (pp2 on two
H200s, docs/serving.md "Host syncs": 22,796 tokens/s against 31,562 read one pass late). Here the flags are copied
into a pinned buffer of the group as they arrive (`put`) and read when the group's next pass is through (`take`), at
the same point of the schedule on every rank; by then the copy is long done. The scheduler applies them
(`Scheduler.end`): a row that emitted EOS has computed one more token, which it drops.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .passes import Pass


class LateFlags:
    """device: where the flags arrive; group_rows: the row count of each group (the size of its pinned buffer)."""

    def __init__(self, device: torch.device, group_rows: Sequence[int]):
        self.cuda = torch.device(device).type == "cuda"
        # group -> (pass, pinned [rows, 2] copy of its message and the copy's event; on CPU: its flags, read at put)
        self.pending: Dict[int, Tuple[Pass, Union[torch.Tensor, List[int]], Optional[torch.cuda.Event]]] = {}
        self.host = [torch.zeros(n, 2, dtype=torch.long, pin_memory=True) for n in group_rows] if self.cuda else []
        self.stream = torch.cuda.current_stream(device) if self.cuda else None  # looked up once (see Uploader)

    def put(self, group: int, p: Pass, message: torch.Tensor) -> None:
        """Start copying pass p's message [rows, 2] (tokens, EOS flags) to the host. The group's pinned buffer is
        free: `take` waited for its previous copy before this pass finished. The whole message travels, so the copy
        needs no strided gather of the flags column."""
        if not self.cuda:  # read now: the message may be a graph's static output, which the next replay rewrites
            self.pending[group] = (p, message[:, 1].tolist(), None)
            return
        host = self.host[group][: message.shape[0]]
        host.copy_(message, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        self.pending[group] = (p, host, copied)

    def take(self, group: int) -> Optional[Tuple[Pass, List[int]]]:
        """The group's previous pass and its EOS flags (one int per pass row), or None; waits for the copy (done)."""
        got = self.pending.pop(group, None)
        if got is None:
            return None
        p, host, copied = got
        if copied is None:  # CPU: read at `put`
            return p, host
        copied.synchronize()
        return p, host[:, 1].tolist()
