"""Graph manager logic without CUDA: shape-class choice, padding, static buffers, cache bypass, failure modes, report.

The capture itself is injected: `FakeCapturer` behaves like a CUDA graph where it matters here — the output is one
static tensor that every replay overwrites in place — so an engine that held on to a stale output would fail.
"""

import gc
import json

import pytest
import torch

from dsaflow.pipeline.capture_guard import gc_paused
from dsaflow.serve.graph_manager import (
    GraphCaptureError,
    GraphManager,
    ShapeClassError,
    StaticInput,
    choose_shape_class,
    pad_into,
)
from dsaflow.serve.report import CaptureRecord, CaptureReport, MissingGraphError, check_complete


class FakeGraph:
    def __init__(self, fn, output):
        self.fn, self.output, self.pool_bytes, self.replays = fn, output, 1234, 0

    def replay(self):
        self.replays += 1
        fresh = self.fn()
        outputs, fresh = (self.output, fresh) if isinstance(fresh, tuple) else ((self.output,), (fresh,))
        for static, new in zip(outputs, fresh):
            static.copy_(new)  # static outputs, overwritten in place like a real graph replay
        return self.output


class FakeCapturer:
    def __init__(self, fail_on=()):
        self.calls, self.fail_on, self.graphs = 0, set(fail_on), []

    def __call__(self, fn):
        self.calls += 1
        out = fn()
        first = out[0] if isinstance(out, tuple) else out  # a block may return several outputs
        if first.shape[0] in self.fail_on:
            raise RuntimeError("operation not permitted when stream is capturing")
        g = FakeGraph(fn, out)
        self.graphs.append(g)
        return g


def double_block(seen):
    """A decode-like block: out[b] = 2 * x[b] + positions[b]; records the padded views it saw."""

    def fn(v):
        seen.append({k: t.clone() for k, t in v.items()})
        return 2 * v["x"].float() + v["positions"].float()

    return fn


def make_manager(classes=(1, 2, 4, 8), capturer=None, **kw):
    seen = []
    m = GraphManager("cpu", capturer=capturer or FakeCapturer(), **kw)
    top = classes[-1]
    m.register(
        "decode",
        "decode",
        0,
        classes,
        0,
        double_block(seen),
        {"x": StaticInput((top, 1), torch.long, 0), "positions": StaticInput((top, 1), torch.long, -1)},
    )
    return m, seen


def test_choose_shape_class_is_smallest_fit():
    classes = (1, 2, 4, 8, 16)
    for n in range(1, 17):
        c = choose_shape_class(classes, n)
        assert c >= n and all(k < n for k in classes if k < c)
    with pytest.raises(ShapeClassError, match="largest shape class 16"):
        choose_shape_class(classes, 17)
    with pytest.raises(ShapeClassError):
        choose_shape_class(classes, 0)


def test_pad_into_copies_and_pads_along_dim():
    dst = torch.full((3, 8, 2), 7.0)
    src = torch.randn(3, 5, 2)
    pad_into(dst.narrow(1, 0, 6), src, dim=1, pad_value=-1)
    assert torch.equal(dst[:, :5], src)
    assert (dst[:, 5] == -1).all() and (dst[:, 6:] == 7).all()  # only the class's rows are touched
    with pytest.raises(ShapeClassError):
        pad_into(dst.narrow(1, 0, 4), src, dim=1, pad_value=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_run_pads_to_class_and_returns_first_rows(n):
    m, seen = make_manager()
    m.capture_all()
    seen.clear()
    x = torch.randint(0, 100, (n, 1))
    pos = torch.arange(n).view(n, 1) + 10
    out = m.run("decode", 0, n, {"x": x, "positions": pos})
    assert out.shape == (n, 1)
    assert torch.equal(out, 2 * x.float() + pos.float())
    c = choose_shape_class((1, 2, 4, 8), n)
    v = seen[-1]
    assert v["x"].shape[0] == c
    assert (v["positions"][n:] == -1).all() and (v["x"][n:] == 0).all()  # padding rows: position -1, token 0


def test_static_buffers_allocated_once_and_reused():
    m, _ = make_manager()
    m.capture_all()
    ptrs = {k: b.data_ptr() for k, b in m.blocks[("decode", 0)].buffers.items()}
    for n in (3, 1, 8, 2):
        m.run(
            "decode", 0, n, {"x": torch.ones(n, 1, dtype=torch.long), "positions": torch.zeros(n, 1, dtype=torch.long)}
        )
    assert {k: b.data_ptr() for k, b in m.blocks[("decode", 0)].buffers.items()} == ptrs
    assert m.blocks[("decode", 0)].buffers["x"].shape == (8, 1)  # sized to the largest class


def test_cache_on_captures_once_bypass_captures_every_call():
    cap_on, cap_off = FakeCapturer(), FakeCapturer()
    on, _ = make_manager(capturer=cap_on, cache=True)
    off, _ = make_manager(capturer=cap_off, cache=False)
    on.capture_all(), off.capture_all()
    assert cap_on.calls == cap_off.calls == 4
    outs = []
    for m in (on, off):
        res = []
        for n in (3, 3, 1, 8):
            x = torch.arange(n).view(n, 1)
            res.append(m.run("decode", 0, n, {"x": x, "positions": x + 1}).clone())
        outs.append(res)
    assert cap_on.calls == 4  # no capture after setup
    assert cap_off.calls == 8  # evict before lookup: one fresh capture per call
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_output_is_static_and_overwritten_by_next_replay():
    m, _ = make_manager()
    m.capture_all()
    x = torch.ones(4, 1, dtype=torch.long)
    first = m.run("decode", 0, 4, {"x": x, "positions": x})
    kept = first.clone()
    m.run("decode", 0, 4, {"x": 3 * x, "positions": x})
    assert not torch.equal(first, kept)  # the same static storage: callers must consume outputs before replaying


def test_capture_failure_errors_by_default():
    m, _ = make_manager(capturer=FakeCapturer(fail_on={4}))
    with pytest.raises(GraphCaptureError, match=r"'decode' \(shape class 4, stage 0\).*on_failure=eager"):
        m.capture_all()


def test_capture_failure_eager_is_reported_and_still_correct():
    m, _ = make_manager(capturer=FakeCapturer(fail_on={4}), on_failure="eager")
    report = m.capture_all()
    status = {r.shape_class: r.status for r in report.records}
    assert status == {1: "captured", 2: "captured", 4: "eager", 8: "captured"}
    assert "eager" in report.render() and "stream is capturing" in report.render()
    x = torch.arange(3).view(3, 1)
    assert torch.equal(m.run("decode", 0, 3, {"x": x, "positions": x}), 3 * x.float())


def test_cpu_device_without_capturer_is_loud():
    m = GraphManager("cpu")
    m.register("decode", "decode", 0, (1, 2), 0, lambda v: v["x"] * 1, {"x": StaticInput((2, 1), torch.long, 0)})
    with pytest.raises(GraphCaptureError, match="CUDA graphs need a CUDA device"):
        m.capture_all()
    m2 = GraphManager("cpu", on_failure="eager")
    m2.register("decode", "decode", 0, (1, 2), 0, lambda v: v["x"] * 1, {"x": StaticInput((2, 1), torch.long, 0)})
    assert all(r.status == "eager" for r in m2.capture_all().records)


def test_force_eager_runs_same_padding_without_capture():
    cap = FakeCapturer()
    m, seen = make_manager(capturer=cap, force_eager=True)
    m.capture_all()
    assert cap.calls == 0
    x = torch.arange(3).view(3, 1)
    assert torch.equal(m.run("decode", 0, 3, {"x": x, "positions": x}), 3 * x.float())
    assert seen[-1]["x"].shape[0] == 4


def test_register_validates_classes_and_buffer_sizes():
    m = GraphManager("cpu", capturer=FakeCapturer())
    with pytest.raises(ValueError, match="strictly increasing"):
        m.register("d", "decode", 0, (4, 2), 0, lambda v: v["x"], {"x": StaticInput((4, 1), torch.long, 0)})
    with pytest.raises(ValueError, match="largest class"):
        m.register("d", "decode", 0, (2, 4), 0, lambda v: v["x"], {"x": StaticInput((2, 1), torch.long, 0)})
    with pytest.raises(ValueError, match="on_failure"):
        GraphManager("cpu", on_failure="ignore")


def test_prefill_pads_token_dim():
    m = GraphManager("cpu", capturer=FakeCapturer())
    seen = []
    m.register(
        "prefill",
        "prefill",
        1,
        (4, 8),
        1,
        double_block(seen),
        {"x": StaticInput((2, 8), torch.long, 0), "positions": StaticInput((2, 8), torch.long, -1)},
    )
    m.capture_all()
    x = torch.arange(10).view(2, 5)
    out = m.run("prefill", 1, 5, {"x": x, "positions": x})
    assert out.shape == (2, 5) and torch.equal(out, 3 * x.float())
    assert seen[-1]["x"].shape == (2, 8) and (seen[-1]["positions"][:, 5:] == -1).all()


def test_report_contents_json_and_missing_check(tmp_path):
    m, _ = make_manager()
    report = m.capture_all()
    assert [(r.block, r.shape_class, r.device, r.status) for r in report.records] == [
        ("decode", c, "cpu", "captured") for c in (1, 2, 4, 8)
    ]
    text = report.render()
    for word in ("decode", "class", "device", "pool MiB", "captured"):
        assert word in text
    path = report.write_json(str(tmp_path))
    data = json.loads(open(path).read())
    assert data["captured"] == 4 and data["pool_bytes"] == 4 * 1234 and data["records"][0]["device"] == "cpu"
    with pytest.raises(MissingGraphError, match=r"prefill\[16\] of stage 0 \(never captured\)"):
        check_complete([("decode", 0, 1), ("prefill", 0, 16)], report.records, allow_eager=False)
    eager = [CaptureRecord("decode", "decode", 1, "cpu", 0, "eager", reason="boom")]
    with pytest.raises(MissingGraphError, match="eager: boom"):
        check_complete([("decode", 0, 1)], eager, allow_eager=False)
    check_complete([("decode", 0, 1)], eager, allow_eager=True)
    assert "no graph blocks" in CaptureReport(3, []).render()


class FakeCuda:
    """Stands in for the torch.cuda calls CudaGraphCapturer makes, recording their order (CPU-only check of the
    capture protocol; the real thing runs in tests/test_graphs_gpu.py)."""

    def __init__(self):
        self.log, self.mode, self.reserved = [], 0, 1000

    def install(self, monkeypatch):
        import contextlib

        cuda = torch.cuda
        fake = self

        class Stream:
            def __init__(self, device=None):
                fake.log.append(("stream", str(device)))

            def wait_stream(self, other):
                fake.log.append(("wait",))

        class Graph:
            def replay(self):
                fake.log.append(("replay",))

        @contextlib.contextmanager
        def ctx(name, *a, **k):
            fake.log.append((name + ">",) + tuple(str(x) for x in a) + tuple(sorted(k)))
            yield
            fake.log.append(("<" + name,))

        def graph_ctx(g, pool=None, stream=None):
            fake.reserved += 4096  # the capture grows the pool
            return ctx("graph", pool=pool, stream=stream)

        patches = {
            "device": lambda d: ctx("device", d),
            "current_device": lambda: 0,
            "graph_pool_handle": lambda: "pool0",
            "Stream": Stream,
            "current_stream": lambda d=None: Stream("current"),
            "stream": lambda s: ctx("on_stream"),
            "get_sync_debug_mode": lambda: fake.mode,
            "set_sync_debug_mode": self.set_mode,
            "synchronize": lambda d=None: None,
            "empty_cache": lambda: None,
            "memory_reserved": lambda d=None: fake.reserved,
            "CUDAGraph": Graph,
            "graph": graph_ctx,
        }
        for name, value in patches.items():
            monkeypatch.setattr(cuda, name, value)

    def set_mode(self, mode):
        self.log.append(("sync_debug", mode))
        self.mode = mode


def test_cuda_capturer_protocol(monkeypatch):
    from dsaflow.serve.graph_manager import CudaGraphCapturer

    fake = FakeCuda()
    fake.install(monkeypatch)
    calls = []

    def fn():
        calls.append(fake.mode)  # the sync-debug mode in force during each call
        return torch.ones(2)

    assert CudaGraphCapturer(torch.device("cuda")).device == torch.device("cuda", 0)  # named: the current device
    cap = CudaGraphCapturer(torch.device("cuda", 1), warmup=2)
    g = cap(fn)
    assert calls == [0, "error", "error", 0]  # prime (may sync: Triton compile), 2 guarded warm-ups, the capture
    assert fake.mode == 0 and ("sync_debug", 0) in fake.log  # the previous mode is restored
    assert ("graph>", "pool", "stream") in fake.log  # captured into the device pool, on the side stream
    assert g.pool_bytes == 4096
    g.replay()
    assert fake.log[-1] == ("<device",) and ("replay",) in fake.log  # not the current device (0): under its guard
    from dsaflow.serve.graph_manager import CapturedGraph

    on_current = CapturedGraph(torch.cuda.CUDAGraph(), torch.ones(1), torch.device("cuda", 0), 0)
    fake.log.clear()
    on_current.replay()
    assert fake.log == [("replay",)]  # already on its device: no guard

    def broken():
        if fake.mode == "error":
            raise RuntimeError("called a synchronizing op")
        return torch.ones(2)

    with pytest.raises(RuntimeError, match="synchronizing"):
        cap(broken)
    assert fake.mode == 0  # restored even when a warm-up fails


class GcStateCapturer(FakeCapturer):
    """Records whether Python's garbage collector could run automatically during each capture."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gc_enabled = []

    def __call__(self, fn):
        self.gc_enabled.append(gc.isenabled())
        return super().__call__(fn)


@pytest.mark.parametrize("fails", [False, True])
def test_captures_run_with_the_garbage_collector_paused(fails):
    """A collection during a capture may free a dead CUDA graph, which fails the capture: the collector is off while
    a capture runs and back on after it, also after a failed capture, and stays off where the caller had it off."""
    cap = GcStateCapturer(fail_on={4} if fails else ())
    m, _ = make_manager(capturer=cap, on_failure="eager")
    assert gc.isenabled()
    m.capture_all()
    assert cap.gc_enabled == [False] * 4 and gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
