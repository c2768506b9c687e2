"""The continuous-batching scheduler on the host alone (dsaflow.serve.scheduler): no model, only passes."""

from dsaflow.serve.passes import Request
from dsaflow.serve.scheduler import Scheduler, group_ranges, prefill_row_classes


def requests(lengths, max_new=4):
    return [Request(i, [1] * n, max_new) for i, n in enumerate(lengths)]


def drain(s: Scheduler, group: int = 0):
    """Every pass of the group until it has no work -> the passes."""
    passes = []
    while s.has_work(group):
        p = s.next_pass(group)
        passes.append(p)
        s.finish(p)
    return passes


def test_prefill_row_classes_reach_one_32nd_of_the_group():
    assert prefill_row_classes(64) == (2, 4, 8, 16, 32, 64)
    assert prefill_row_classes(8) == (1, 2, 4, 8)


def test_a_refill_of_short_prompts_and_one_long_one_takes_the_short_chunk_class():
    """15 prompts of 100 tokens and one of 3000 over 16 rows: with the graph classes 128 / 512 / 1024, the first
    pass prefills 128 columns (the short prompts end there and sample), not 1024 columns of mostly padding."""
    lengths = [100] * 15 + [3000]
    with_classes = Scheduler(requests(lengths), group_ranges(16, 1), 1024, narrow=True, chunk_classes=(128, 512, 1024))
    first = with_classes.next_pass(0)
    assert first.T == 128 and len(first.emit) == 15
    plain = Scheduler(requests(lengths), group_ranges(16, 1), 1024, narrow=True)
    assert plain.next_pass(0).T == 1024
    with_classes.finish(first)
    # the long prompt goes on alone, now in the largest class: fewer passes than 128 columns at a time
    passes = drain(with_classes)
    long_chunks = [p.T for p in passes if not p.decode_only]
    assert long_chunks[0] == 1024 and sum(long_chunks) == 3000 - 128 and len(long_chunks) == 3
    assert with_classes.generated == {i: 4 for i in range(16)}


def test_compacting_moves_copy_every_written_position():
    """A refill moves rows that already hold keys; the pass says how many positions to copy: at least every moved
    row's written ones (prompt tokens sent plus tokens generated)."""
    lengths = [5, 40, 7, 30, 9, 20, 11, 3]
    reqs = [Request(i, [1] * n, 2 + 3 * (i % 3)) for i, n in enumerate(lengths)]
    s = Scheduler(reqs, group_ranges(4, 1), 16, narrow=True)
    checked = 0
    while s.has_work(0):
        before = {id(r): r.offset + r.generated for r in s.rows[0] if r is not None}
        p = s.next_pass(0)
        if p.moves:
            rows = s.rows[0]
            written = [before[id(rows[k])] for _, k in p.moves]
            assert p.move_len == max(written) > 0
            checked += 1
        s.finish(p)
    assert checked and sorted(s.generated.values()) == sorted(r.max_new for r in reqs)


def test_the_drain_closes_the_holes_that_finished_rows_leave():
    """Once the queue is empty, rows finish in an order unrelated to where narrow refills put them; the scheduler
    compacts the group whenever a quarter of its decode span is idle, so no decode pass computes more than 4/3 of
    its decoding rows (plus one), and every request still gets all its tokens."""
    limits = [2 + (7 * i) % 29 for i in range(32)]  # finishing order scattered over the rows
    reqs = [Request(i, [1] * (3 + i % 5), m) for i, m in enumerate(limits)]
    s = Scheduler(reqs, group_ranges(32, 1), 16, narrow=True)
    passes = drain(s)
    decodes = [p for p in passes if p.decode_only]
    assert any(p.moves for p in decodes), "the drain compacted the group"
    for p in decodes:
        assert p.rows <= len(p.emit) * 4 / 3 + 1
    assert s.generated == {i: m for i, m in enumerate(limits)}
    # fixed batches never move rows
    fixed = Scheduler([Request(r.index, r.prompt, r.max_new) for r in reqs], group_ranges(32, 1), 16, refill=False)
    assert not any(p.moves for p in drain(fixed))


def test_balanced_prefill_chunks_cost_what_the_other_groups_decode_passes_cost():
    """Two groups of 8 rows, 16-token prompts, chunk 16. Group 0 fills first: no other group decodes, so it
    prefills whole chunks. Group 1 then prefills 8 rows beside group 0's decode passes of 8 rows: with `balance`
    its chunks hold 1 token (8 row-tokens, what a decode pass beside it holds), so the rank that runs the decode
    pass does not idle; without, 16 tokens (128 row-tokens). Both serve every request to its limit. Fixed
    batches keep their chunks."""
    for balance in (False, True):
        s = Scheduler(requests([16] * 16, max_new=24), group_ranges(16, 2), 16, narrow=True, balance=balance)
        first = s.next_pass(0)
        assert (first.rows, first.T) == (8, 16)
        s.finish(first)
        chunks = []
        while not (p := s.next_pass(1)).decode_only:
            assert p.rows == 8
            chunks.append(p.T)
            s.finish(p)
            s.finish(s.next_pass(0))  # group 0 decodes beside it
        s.finish(p)
        assert chunks == ([1] * 16 if balance else [16])
        while s.has_work(0) or s.has_work(1):
            for g in (0, 1):
                if s.has_work(g):
                    s.finish(s.next_pass(g))
        assert s.generated == {i: 24 for i in range(16)}
    fixed = Scheduler(requests([16] * 16), group_ranges(16, 2), 16, refill=False, narrow=True, balance=True)
    fixed.finish(fixed.next_pass(0))
    assert fixed.next_pass(1).T == 16


def test_eos_applied_one_pass_late_drops_the_token_past_it():
    """Request 1 samples EOS as its first token; the group's next pass was built before the flags were read, so it
    decodes both rows: `end` frees request 1 with one token, and `finish` then drops its second token."""
    s = Scheduler(requests([2, 2], max_new=4), group_ranges(2, 1), 16)
    first = s.next_pass(0)
    assert s.finish(first) == [] and [e[2] for e in first.emit] == [0, 1]
    second = s.next_pass(0)  # built before the first pass's flags were read
    assert second.decode_only and [e[2] for e in second.emit] == [0, 1]
    assert s.end(first, [False, True]) == [1]
    assert s.finish(second) == [] and [e[2] for e in second.emit] == [0]
    assert s.generated[1] == 1 and s.rows[0][1] is None
    assert s.end(second, [True, True]) == [0]  # the dropped row's flag is ignored
    assert s.generated[0] == 2 and not s.has_work(0)
