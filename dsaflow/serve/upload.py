"""One host-to-device copy per pass: the host-known integers of a pass that this rank's stages read.

A decode pass of `model=small` replays one CUDA graph per stage, so the host work around it decides whether a rank
keeps its GPU fed. Making about ten small tensors per pass from Python lists, each with its own pinned buffer and
copy, held a host-bound configuration to less than half the rate it now reaches (docs/serving.md, "Host work per
pass"). Here every vector a rank needs is packed into one int64 array, one pinned slot and one non-blocking copy, and
the engine reads views of it; the slots are allocated once per run (`Uploader`).
"""

from __future__ import annotations

import ctypes
from array import array
from itertools import chain
from typing import Dict, List, Sequence, Tuple

import torch

from .passes import Pass


def h2d(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints -> a device int64 tensor without a host sync (pinned memory, non-blocking copy on GPU)."""
    t = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pass_vectors(
    p: Pass, sample_cols: List[int], keys: List[int], first: bool, last: bool, out_width: int, keyed: bool
) -> Dict[str, Tuple[List[int], Tuple[int, ...]]]:
    """name -> (host ints, shape) of every vector a rank reads for pass `p`.

    Every rank: `positions` [rows, T]; with a refill's row moves, `move_from` / `move_to` [moves].
    Stage 0's rank (`first`): `tokens` [rows, T] unless the pass only decodes (its rows then read their previous
    tokens); `decode` [rows] (1 = column 0 takes the row's previous token) when the pass mixes decoding and
    prefilling rows; `fed_from` [emitted]: the pass rows that sample (their tokens are the group's next input).
    The last stage's rank (`last`): `cols` [rows] (the sampled column of each row) when T > 1; `keys` [rows] when
    sampling is keyed (temperature > 0); `emit_slots` [emitted]: request x out_width + token index, a flat index
    into the output tokens; `emit_rows` [emitted]: the pass rows that sample.
    `fed_from` and `emit_rows` are left out when every row of the pass samples, in order (a full decode step).
    A mixed pass (`p.token_major`): `positions`, `tokens` and `token_rows` (each token's group row) are [1, T];
    stage 0 swaps the decoding rows' previous tokens in at `swap_cols` [decoding] from rows `swap_rows`.
    """
    rows, T = p.rows, p.T
    shape = (1, T) if p.token_major else (rows, T)
    out: Dict[str, Tuple[List[int], Tuple[int, ...]]] = {"positions": (list(chain.from_iterable(p.positions)), shape)}
    if p.token_major:
        out["token_rows"] = (list(p.token_rows), shape)
    if p.moves:
        out["move_from"] = ([a for a, _ in p.moves], (len(p.moves),))
        out["move_to"] = ([b for _, b in p.moves], (len(p.moves),))
    emitted = [e[0] for e in p.emit]
    every_row = emitted == list(range(rows))
    if first:
        if not p.decode_only:
            out["tokens"] = (list(chain.from_iterable(p.tokens)), shape)
        if p.token_major:
            swaps = [(c, r) for r, c, _, _ in p.emit if p.decode[r]]
            out["swap_cols"] = ([c for c, _ in swaps], (len(swaps),))
            out["swap_rows"] = ([r for _, r in swaps], (len(swaps),))
        elif not p.decode_only and any(p.decode):
            out["decode"] = ([int(d) for d in p.decode], (rows,))
        if not every_row:
            out["fed_from"] = (emitted, (len(emitted),))
    if last:
        if T > 1 or p.token_major:  # a mixed pass of one token still samples through cols
            out["cols"] = (list(sample_cols), (rows,))
        if keyed:
            out["keys"] = (list(keys), (rows,))
        if not every_row:
            out["emit_rows"] = (emitted, (len(emitted),))
        out["emit_slots"] = ([req * out_width + k for _, _, req, k in p.emit], (len(emitted),))
    return out


def _pack(vectors: Dict[str, Tuple[List[int], Tuple[int, ...]]]):
    """-> (every vector's ints in one list, name -> (offset, length, shape))."""
    flat: List[int] = []
    spans = {}
    for name, (values, shape) in vectors.items():
        spans[name] = (len(flat), len(values), shape)
        flat.extend(values)
    return flat, spans


def _views(buf: torch.Tensor, spans) -> Dict[str, torch.Tensor]:
    return {
        name: buf[a : a + n] if len(shape) == 1 else buf[a : a + n].view(shape) for name, (a, n, shape) in spans.items()
    }


def upload(vectors: Dict[str, Tuple[List[int], Tuple[int, ...]]], device: torch.device) -> Dict[str, torch.Tensor]:
    """The vectors of `pass_vectors` in one buffer and one copy -> name -> a device int64 view of its shape."""
    flat, spans = _pack(vectors)
    return _views(h2d(flat, device), spans)


class Uploader:
    """`upload` for every pass of a run, through buffers allocated once: on a GPU a ring of `slots` pinned staging
    slots and as many device slots, each `slot_ints` int64 long. A pass's ints are copied into its pinned slot with
    one memmove and sent with one non-blocking copy.

    Why: a fresh pinned buffer per pass (`h2d`) cost about 0.1 ms of host time per pass on an H200 machine, a fifth
    of a pp4 rank's whole tick. Reuse is safe because (1) before a pinned slot is overwritten, the host waits for
    the event recorded after its last copy (it waits only when it runs more than `slots` passes ahead of its GPU,
    which then still has that many queued), and (2) a device slot is
    rewritten by a copy on the same stream as every kernel that read it, so after them; a pass's views are read while
    it is in flight, at most one pass per stage, so `slots` must exceed the number of stages (checked). A pass whose
    ints do not fit a slot (a long prefill chunk) takes its own pinned buffer (`h2d`). On CPU: `upload`."""

    def __init__(self, device: torch.device, slot_ints: int, slots: int = 64, stages: int = 1):
        if slots <= stages:
            raise ValueError(f"Uploader: {slots} slots cannot hold the passes in flight over {stages} stages.")
        self.device, self.slot_ints, self.slots = torch.device(device), int(slot_ints), int(slots)
        self.cuda = self.device.type == "cuda"
        self.next = 0
        if self.cuda:
            self.host = torch.empty(self.slots * self.slot_ints, dtype=torch.long, pin_memory=True)
            self.dev = torch.empty(self.slots * self.slot_ints, dtype=torch.long, device=self.device)
            self.copied = [torch.cuda.Event() for _ in range(self.slots)]  # recorded after each slot's last copy
            # the stream of every copy, looked up once: Event.record() with no stream looks up the current device
            # and stream on each call (about 40 us per pass under cProfile on an H200 machine's host)
            self.stream = torch.cuda.current_stream(self.device)

    def __call__(self, vectors: Dict[str, Tuple[List[int], Tuple[int, ...]]]) -> Dict[str, torch.Tensor]:
        flat, spans = _pack(vectors)
        n = len(flat)
        if not self.cuda or n > self.slot_ints or n == 0:
            return _views(h2d(flat, self.device), spans)
        i = self.next
        self.next = (i + 1) % self.slots
        self.copied[i].synchronize()  # the slot's previous copy has left its pinned memory
        a = i * self.slot_ints
        values = array("q", flat)
        ctypes.memmove(self.host.data_ptr() + 8 * a, values.buffer_info()[0], 8 * n)
        buf = self.dev[a : a + n]
        buf.copy_(self.host[a : a + n], non_blocking=True)
        self.copied[i].record(self.stream)
        return _views(buf, spans)
