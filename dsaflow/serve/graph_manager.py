"""CUDA graph manager: capture named blocks once per shape class on this rank's device, replay them with padding.

One `GraphManager` per device (per rank). A block is a callable over static input buffers, e.g. "the decode step of
stage 1 for a batch of c rows". For each requested shape class c the manager

1. allocates the static input buffers once, at the largest class (before any capture), filled with pad values;
2. captures `fn(views of the first c rows)` with `CudaGraphCapturer`: under `torch.cuda.device(dev)`, on one side
   stream, into one graph memory pool shared by every block of this device (they never replay concurrently), after
   warm-up runs under `torch.cuda.set_sync_debug_mode("error")` so a hidden host sync fails loudly;
3. at `run(block, n, inputs)` picks the smallest captured class >= n, copies the inputs into the static buffers and
   pads the rest (padding rows get position -1, so they write only the cache's trash row), replays, and returns a
   view of the first n rows of the static output. The view is overwritten by the next replay: consume it first.

`cache=False` is the debug bypass: every `run` evicts the (block, class) graph and captures it afresh, so cached and
bypassed outputs can be compared bit for bit. `on_failure="error"` stops on a capture failure; `"eager"` runs that
block eagerly (same padding, same buffers) and records it as eager in the report.

Everything but the capture itself is pure Python over tensors, so it is tested on CPU with a fake capturer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dsaflow.model import dense_prefill
from dsaflow.pipeline.capture_guard import gc_paused

from .report import CaptureRecord, CaptureReport, check_complete


class GraphCaptureError(RuntimeError):
    """Capturing a requested block failed and graphs.on_failure=error."""


class ShapeClassError(ValueError):
    """A call is larger than the largest shape class captured for its block."""


def choose_shape_class(classes: Sequence[int], n: int) -> int:
    """Smallest class >= n from sorted positive `classes`; raises ShapeClassError when n exceeds them all."""
    if n < 1:
        raise ShapeClassError(f"a graph block was called with size {n}; sizes start at 1.")
    for c in classes:
        if c >= n:
            return c
    raise ShapeClassError(
        f"size {n} exceeds the largest shape class {max(classes)} of the block (classes {list(classes)}): add a class "
        f">= {n} to graphs.blocks[..].shape_classes or lower serve.max_batch / serve.prefill_chunk."
    )


def sync_error_guard(on: bool):
    """A context in which any CUDA host sync raises (torch.cuda.set_sync_debug_mode("error")); a no-op when off."""
    if not on:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def guard():
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return guard()


def pad_into(dst: torch.Tensor, src: torch.Tensor, dim: int, pad_value: float) -> None:
    """Copy src into the first src.shape[dim] entries of dst along `dim` and fill the rest with pad_value.

    dst [.., c, ..] (a static buffer view), src [.., n, ..] with n <= c and equal other dims. No allocation."""
    n = src.shape[dim]
    if n > dst.shape[dim] or src.dim() != dst.dim():
        raise ShapeClassError(f"input of shape {tuple(src.shape)} does not fit the static buffer {tuple(dst.shape)}")
    dst.narrow(dim, 0, n).copy_(src)
    if n < dst.shape[dim]:
        dst.narrow(dim, n, dst.shape[dim] - n).fill_(pad_value)


@dataclass(frozen=True)
class StaticInput:
    """One static input of a block: shape at the largest class, dtype, and the value that pads unused rows."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    pad: float = 0


@dataclass
class Block:
    name: str  # block name from the config (decode, prefill)
    kind: str
    stage: int
    classes: Tuple[int, ...]  # sorted shape classes
    class_dim: int  # the padded dimension (0 = batch for decode, 1 = tokens for prefill)
    fn: Callable[[Dict[str, torch.Tensor]], torch.Tensor]
    inputs: Dict[str, StaticInput]
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    _views: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    def views(self, c: int) -> Dict[str, torch.Tensor]:
        """The static buffers narrowed to class c, made once per class (a replay needs them on every pass)."""
        got = self._views.get(c)
        if got is None or got.keys() != self.buffers.keys():
            got = self._views[c] = {k: b.narrow(self.class_dim, 0, c) for k, b in self.buffers.items()}
        return got


class CudaGraphCapturer:
    """Captures callables as CUDA graphs on one device: one side stream and one memory pool for all of them."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device, self.warmup = torch.device(device), warmup
        if self.device.index is None:  # "cuda": the current device, named, so that a replay can skip the device guard
            self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device=self.device)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                fn()  # prime: first calls compile/autotune Triton kernels, which may sync by design
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")  # any host sync in the block itself now raises
                try:
                    for _ in range(self.warmup):
                        fn()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # torch.cuda.graph does this too; doing it first makes the pool delta honest
            before = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = fn()
            torch.cuda.synchronize(self.device)
            grown = torch.cuda.memory_reserved(self.device) - before
        return CapturedGraph(graph, output, self.device, max(grown, 0))


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # static output, lives in the graph pool
    device: torch.device
    pool_bytes: int

    def replay(self) -> torch.Tensor:
        if torch.cuda.current_device() == self.device.index:  # the engine runs on its device: skip the guard's cost
            self.graph.replay()
        else:
            with torch.cuda.device(self.device):
                self.graph.replay()
        return self.output


class GraphManager:
    """Graph blocks of one device. `capturer(fn) -> object with .replay() -> Tensor and .pool_bytes` is injectable
    (tests pass a fake); by default a CudaGraphCapturer for `device` is built on first capture."""

    def __init__(
        self,
        device: torch.device | str,
        *,
        cache: bool = True,
        on_failure: str = "error",
        force_eager: bool = False,
        rank: int = 0,
        warmup: int = 2,
        capturer: Optional[Callable] = None,
    ):
        if on_failure not in ("error", "eager"):
            raise ValueError(f"graphs.on_failure={on_failure!r} is not valid: use error or eager.")
        self.device, self.cache, self.on_failure, self.rank = torch.device(device), cache, on_failure, rank
        self.force_eager = force_eager  # run every block eagerly with the same padding (the reference for tests)
        self.warmup = warmup
        self._capturer = capturer
        self.blocks: Dict[Tuple[str, int], Block] = {}
        self._graphs: Dict[Tuple[str, int, int], object] = {}
        self._eager: Dict[Tuple[str, int, int], str] = {}  # key -> reason it runs eagerly
        self._records: Dict[Tuple[str, int, int], CaptureRecord] = {}
        self.captures = 0  # number of captures performed (grows per call when cache=False)

    # --- registration and capture -----------------------------------------------------------------------------
    def register(
        self,
        name: str,
        kind: str,
        stage: int,
        classes: Sequence[int],
        class_dim: int,
        fn: Callable[[Dict[str, torch.Tensor]], torch.Tensor],
        inputs: Dict[str, StaticInput],
    ) -> Block:
        """Declare a block and allocate its static buffers once, at the largest class, filled with pad values."""
        classes = tuple(int(c) for c in classes)
        if not classes or list(classes) != sorted(set(classes)) or classes[0] < 1:
            raise ValueError(f"block {name!r}: shape classes must be positive and strictly increasing, got {classes}")
        block = Block(name, kind, stage, classes, class_dim, fn, dict(inputs))
        for key, spec in inputs.items():
            if spec.shape[class_dim] != classes[-1]:
                raise ValueError(f"block {name!r}: input {key} must be sized to the largest class {classes[-1]}")
            block.buffers[key] = torch.full(spec.shape, spec.pad, dtype=spec.dtype, device=self.device)
        self.blocks[(name, stage)] = block
        return block

    def requested(self) -> List[Tuple[str, int, int]]:
        return [(b.name, b.stage, c) for b in self.blocks.values() for c in b.classes]

    def capture_all(self) -> CaptureReport:
        """Capture every (block, class); returns the report. Raises per on_failure; checks nothing is missing."""
        for name, stage, c in self.requested():
            self._capture((name, stage, c))
        report = self.report()
        check_complete(self.requested(), report.records, allow_eager=self.on_failure == "eager" or self.force_eager)
        return report

    def report(self) -> CaptureReport:
        return CaptureReport(self.rank, [self._records[k] for k in self.requested() if k in self._records], self.cache)

    def _mark_eager(self, key: Tuple[str, int, int], reason: str) -> None:
        block = self.blocks[key[:2]]
        self._eager[key] = reason
        self._records[key] = CaptureRecord(
            block.name, block.kind, key[2], str(self.device), key[1], "eager", 0, 0.0, reason
        )

    def _capture(self, key: Tuple[str, int, int]) -> None:
        block = self.blocks[key[:2]]
        if self.force_eager:
            return self._mark_eager(key, "forced eager (reference run)")
        if self._capturer is None:
            if self.device.type != "cuda":
                return self._fail(key, f"CUDA graphs need a CUDA device, this rank runs on {self.device}")
            self._capturer = CudaGraphCapturer(self.device, self.warmup)
        views = block.views(key[2])
        t0 = time.perf_counter()
        try:
            with gc_paused():  # a collection mid-capture may free a dead graph, which fails the capture
                graph = self._capturer(lambda: block.fn(views))
        except Exception as exc:  # noqa: BLE001 - any capture failure is reported with its cause
            return self._fail(key, f"{type(exc).__name__}: {exc}")
        self.captures += 1
        self._graphs[key] = graph
        ms = (time.perf_counter() - t0) * 1e3
        self._records[key] = CaptureRecord(
            block.name, block.kind, key[2], str(self.device), key[1], "captured", int(graph.pool_bytes), ms
        )

    def _fail(self, key: Tuple[str, int, int], cause: str) -> None:
        name, stage, c = key
        if self.on_failure == "error":
            raise GraphCaptureError(
                f"capturing graph block {name!r} (shape class {c}, stage {stage}) on {self.device} failed: {cause}. "
                f"Fix the cause, or set graphs.on_failure=eager to run it eagerly (reported), or graphs=off."
            )
        print(
            f"[rank {self.rank}] graph block {name}[{c}] stage {stage} runs EAGERLY (graphs.on_failure=eager): {cause}"
        )
        self._mark_eager(key, cause)

    def evict(self, key: Tuple[str, int, int]) -> None:
        self._graphs.pop(key, None)

    # --- calls -------------------------------------------------------------------------------------------------
    def run(self, name: str, stage: int, n: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Run block (name, stage) for n rows: pad inputs into the static buffers of the smallest class >= n, replay
        (or run eagerly), return the first n rows of the output along the class dim (of each output, for a block
        whose fn returns a tuple)."""
        block = self.blocks[(name, stage)]
        c = choose_shape_class(block.classes, n)
        views = block.views(c)
        for k, x in inputs.items():
            pad_into(views[k], x, block.class_dim, block.inputs[k].pad)
        key = (name, stage, c)
        if key in self._eager:
            out = block.fn(views)
        else:
            if not self.cache:  # debug bypass: evict before lookup, capture afresh
                self.evict(key)
            if key not in self._graphs:
                self._capture(key)
            out = self._graphs[key].replay() if key in self._graphs else block.fn(views)
        if isinstance(out, tuple):
            return tuple(o.narrow(block.class_dim, 0, n) for o in out)
        return out.narrow(block.class_dim, 0, n)


@dataclass(frozen=True)
class StageGraphSpec:
    """What a serving stage's graph blocks need to know besides its module and caches.

    first / last: the stage is the pipeline's first (its input is token ids [rows, T]) / last (its decode graphs
    sample too: -> (message [rows, 2], fp32 logits [rows, V])); dim, dtype: the hidden state's between stages;
    sample(logits, keys): the last stage's sampling; keyed: sampling reads each row's key (temperature > 0);
    receives_indices: the stage opens on S layers that read an earlier stage's indices (cross-stage indices), from
    the cache's static index buffer, which the engine fills before each pass; prefill_paths / prefill_rule: the
    attention paths of prefill passes (`dense_prefill.PATHS`, serve.short_prefill) and the rule that picks them;
    row_classes: the top-row counts of continuous batching's prefill graphs (() when none); groups: microbatch
    groups (a graph per group: its cache rows are baked in)."""

    first: bool
    last: bool
    dim: int
    dtype: torch.dtype
    sample: Callable
    keyed: bool
    receives_indices: bool
    prefill_paths: Tuple[str, ...]
    prefill_rule: Dict[str, int]
    row_classes: Tuple[int, ...]
    groups: int
    key_width: int = 1  # 3 with per-request sampling: keys [rows, 3] (dsaflow.serve.sampling.sample_rowwise)


def graph_block_name(block_name: str, group: int, groups: int, path: str = "sparse") -> str:
    """The graph of a configured block for one group and one prefill attention path: the configured name for group
    0 of one group and the sparse path, else `<name>/g<group>` and `+<path>` appended."""
    name = block_name if groups == 1 else f"{block_name}/g{group}"
    return name if path == "sparse" else f"{name}+{path}"


def register_stage_graphs(graphs: GraphManager, stage: int, module, group_caches, blocks, spec: StageGraphSpec):
    """Register every (block, group) graph of one serving stage with `graphs` -> {(kind, group, path): graph name},
    what the engine replays each pass through. Decode blocks: class = rows, one token each. Prefill blocks: class =
    tokens per chunk at the group's full rows (and, with row classes, over the group's top rows: `<name>/r<c>`), one
    block per attention path label (dsaflow/model/dense_prefill.py). Mixed blocks: class = tokens of a token-major
    pass [1, T], each token's cache row from the static `token_rows` buffer."""
    names: Dict[Tuple[str, int, str], str] = {}
    for block in blocks:
        for g, cache in enumerate(group_caches):
            if block.kind == "decode":
                name = graph_block_name(block.name, g, spec.groups)
                _register_decode(graphs, stage, module, cache, name, block.shape_classes, spec)
                names[("decode", g, "sparse")] = name
            elif block.kind == "mixed":
                name = graph_block_name(block.name, g, spec.groups)
                _register_mixed(graphs, stage, module, cache, name, block.shape_classes, spec)
                names[("mixed", g, "sparse")] = name
            else:
                for path, name in _register_prefill_paths(graphs, stage, module, cache, block, g, spec):
                    names[("prefill", g, path)] = name
    return names


def _stage_input(spec: StageGraphSpec, rows: int, tokens: int) -> StaticInput:
    if spec.first:
        return StaticInput((rows, tokens), torch.long, 0)
    return StaticInput((rows, tokens, spec.dim), spec.dtype, 0)


def _received(spec: StageGraphSpec, cache, positions: torch.Tensor) -> Optional[torch.Tensor]:
    """Cross-stage indices for a stage that opens on S: the [R, T] view of the cache's static index buffer, into
    which the engine copied what the previous stage sent (static memory, so a captured graph reads each pass's
    copy); None for every other stage."""
    if not spec.receives_indices:
        return None
    R, T = positions.shape
    return cache.index[:R, :T]


def _register_decode(graphs, stage, module, cache, name, classes, spec: StageGraphSpec) -> None:
    top = max(classes)
    inputs = {"x": _stage_input(spec, top, 1), "positions": StaticInput((top, 1), torch.long, -1)}
    if spec.last and spec.keyed:
        inputs["keys"] = StaticInput((top,) if spec.key_width == 1 else (top, spec.key_width), torch.long, 0)

    def fn(v):
        out = module.forward_decode(v["x"], v["positions"], cache, indices_in=_received(spec, cache, v["positions"]))
        return spec.sample(out[:, 0], v.get("keys")) if spec.last else out

    graphs.register(name, "decode", stage, classes, 0, fn, inputs)


def _register_prefill_paths(graphs, stage, module, cache, block, group, spec: StageGraphSpec):
    """A prefill block's graphs, one per attention path label with classes it can use -> [(path, graph name)]."""
    topk, cache_rows = module.cfg.index_topk, cache.max_context + 1
    out = []
    for path in dense_prefill.graph_labels(spec.prefill_paths, topk, cache_rows):
        classes = dense_prefill.graph_classes(path, block.shape_classes, topk, **spec.prefill_rule)
        if not classes:
            continue
        name = graph_block_name(block.name, group, spec.groups, path)
        _register_prefill(graphs, stage, module, cache, name, path, classes, spec)
        for c in spec.row_classes[:-1]:  # the top c rows of the group (the last class is the whole group)
            top_rows = cache.rows(cache.max_batch - c, cache.max_batch)
            _register_prefill(graphs, stage, module, top_rows, f"{name}/r{c}", path, classes, spec)
        out.append((path, name))
    return out


def _register_prefill(graphs, stage, module, cache, name, path, classes, spec: StageGraphSpec) -> None:
    """A prefill graph block of one attention path: each class replays the path's static hint
    (`dense_prefill.graph_hint`), so a captured graph never depends on the positions of the pass."""
    rows, top = cache.max_batch, max(classes)
    topk, cache_rows = module.cfg.index_topk, cache.max_context + 1
    inputs = {"x": _stage_input(spec, rows, top), "positions": StaticInput((rows, top), torch.long, -1)}

    def fn(v):
        x, positions = v["x"].contiguous(), v["positions"].contiguous()
        hint = dense_prefill.graph_hint(path, x.shape[1], topk, cache_rows, spec.prefill_rule["max_keys"])
        return module.forward_prefill(x, positions, cache, indices_in=_received(spec, cache, positions), hint=hint)

    graphs.register(name, "prefill", stage, classes, 1, fn, inputs)


def _register_mixed(graphs, stage, module, cache, name, classes, spec: StageGraphSpec) -> None:
    """A mixed graph block: class c = a token-major pass x [1, c] (stage 0: token ids; else [1, c, dim]), its
    positions and token_rows [1, c] in static buffers that the engine fills before each replay (padding: position
    -1, row 0; dsaflow.serve.mixed.pad_mixed_pass). The last stage returns logits [1, c, V]: the engine samples the
    emitting columns outside the graph, as in an eager mixed pass."""
    top = max(classes)
    inputs = {
        "x": _stage_input(spec, 1, top),
        "positions": StaticInput((1, top), torch.long, -1),
        "token_rows": StaticInput((1, top), torch.long, 0),
    }

    def fn(v):
        positions = v["positions"].contiguous()
        received = _received(spec, cache, positions)
        return module.forward_prefill(
            v["x"].contiguous(), positions, cache, indices_in=received, token_rows=v["token_rows"]
        )

    graphs.register(name, "mixed", stage, classes, 1, fn, inputs)
