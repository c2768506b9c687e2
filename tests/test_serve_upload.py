"""A pass's host integers reach the device in one copy, and every view holds what the host pass says."""

from __future__ import annotations

import pytest
import torch

from dsaflow.serve.engine import Uploader, h2d, pass_vectors
from dsaflow.serve.passes import Pass, PassInputs, Request
from dsaflow.serve.sampling import TOKEN_KEY
from dsaflow.serve.scheduler import Scheduler


def upload(vectors, device) -> dict:
    """The pass's vectors through an uploader whose slots hold them all -> {name: device view}."""
    return Uploader(device, 1 << 12)(vectors)


KEY_IDS = {7: 3, 4: 1}  # request -> the id its sampling is keyed by


def vectors_of(p: Pass, first: bool, last: bool, out_width: int, keyed: bool):
    return pass_vectors(p, first, last, KEY_IDS, out_width, keyed)


def names(vectors) -> set:
    return {name for name, _, _ in vectors}


def _prefill_pass() -> Pass:
    """A mixed pass of 3 rows starting at group row 2: row 0 ends its prompt (samples at column 2), row 1 prefills
    on, row 2 decodes (its previous token goes in column 0)."""
    p = Pass(
        0,
        2,
        3,
        4,
        [[5, 6, 7, 0], [8, 9, 10, 11], [0, 0, 0, 0]],
        [[3, 4, 5, -1], [0, 1, 2, 3], [9, -1, -1, -1]],
        [False, False, True],
    )
    p.emit = [(0, 2, 7, 0), (2, 0, 4, 5)]
    p.moves = [(1, 3), (0, 2)]
    return p


def test_views_of_a_mixed_pass_hold_the_host_lists():
    p = _prefill_pass()
    v = upload(vectors_of(p, first=True, last=True, out_width=16, keyed=True), torch.device("cpu"))
    assert torch.equal(v["positions"], torch.tensor(p.positions))
    assert torch.equal(v["tokens"], torch.tensor(p.tokens))
    assert v["decode"].tolist() == [0, 0, 1]
    assert v["cols"].tolist() == [2, 0, 0] and v["keys"].tolist() == [3 * TOKEN_KEY, 0, 1 * TOKEN_KEY + 5]
    assert v["move_from"].tolist() == [1, 0] and v["move_to"].tolist() == [3, 2]
    # rows 0 and 2 sample: their pass rows, and their output slots request x width + token index
    assert v["fed_from"].tolist() == [0, 2] and v["emit_rows"].tolist() == [0, 2]
    assert v["emit_slots"].tolist() == [7 * 16 + 0, 4 * 16 + 5]
    assert PassInputs(**v).emit_slots is v["emit_slots"]  # the typed views are these
    # every view lies in one buffer: one host-to-device copy per pass
    assert len({t.untyped_storage().data_ptr() for t in v.values()}) == 1


def test_a_full_decode_step_uploads_only_positions_and_slots():
    reqs = [Request(i, [1, 2, 3], 4) for i in range(4)]
    sched = Scheduler(reqs, [(0, 4)], chunk=8)
    sched.finish(sched.next_pass(0))  # the prefill pass
    p = sched.next_pass(0)
    assert p.decode_only and [e[0] for e in p.emit] == [0, 1, 2, 3]
    v = upload(vectors_of(p, first=True, last=True, out_width=4, keyed=False), torch.device("cpu"))
    # stage 0 feeds the previous tokens (no token upload); every row samples in order (no row lists); greedy (no keys)
    assert set(v) == {"positions", "emit_slots"}
    assert v["positions"].tolist() == [[3]] * 4
    rows = sched.rows[0]
    assert v["emit_slots"].tolist() == [rows[i].request.index * 4 + rows[i].generated for i in range(4)]


def test_each_rank_uploads_only_what_its_stages_read():
    p = _prefill_pass()
    middle = vectors_of(p, first=False, last=False, out_width=16, keyed=False)
    assert names(middle) == {"positions", "move_from", "move_to"}
    last = vectors_of(p, first=False, last=True, out_width=16, keyed=False)
    assert "tokens" not in names(last) and "fed_from" not in names(last) and "cols" in names(last)


@pytest.mark.gpu
def test_upload_to_the_gpu_needs_no_host_sync():
    p = _prefill_pass()
    vec = vectors_of(p, first=True, last=True, out_width=16, keyed=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        v = upload(vec, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert v["positions"].is_cuda and v["positions"].tolist() == p.positions
    assert h2d([], torch.device("cuda")).numel() == 0


def test_uploader_views_equal_each_vector_made_alone_and_it_checks_its_ring():
    vec = vectors_of(_prefill_pass(), first=True, last=True, out_width=16, keyed=True)
    got = Uploader(torch.device("cpu"), 64)(vec)
    want = {name: torch.tensor(values, dtype=torch.long).view(shape) for name, values, shape in vec}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="slots"):
        Uploader(torch.device("cpu"), 64, slots=4, stages=4)


@pytest.mark.gpu
def test_uploader_ring_wraps_and_every_pass_reads_its_own_ints():
    """Three times round a ring of 4 slots, with a pass too long for a slot in between: every pass's views hold its
    own ints when the GPU reads them (a kernel consumes each pass before the next upload, as a stage does). The GPU
    starts behind a long spin, so the host laps the ring before any copy has run: without the wait on a slot's
    event, its pinned ints would be overwritten before they were copied."""
    up = Uploader(torch.device("cuda"), slot_ints=8, slots=4, stages=2)
    sums, want = [], []
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin ahead of every copy
    torch.cuda.set_sync_debug_mode("error")  # an upload never syncs the device (the slot wait is an event's)
    try:
        for i in range(13):
            n = 20 if i == 5 else 1 + i % 8  # pass 5 does not fit a slot: its own pinned buffer
            values = [1000 * i + k for k in range(n)]
            v = up([("positions", values, (n,))])
            sums.append(v["positions"].sum())  # read on the stream, before later uploads reuse the slot
            want.append(sum(values))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [int(s) for s in sums] == want
