"""Pipeline inference engine: microbatch groups in flight, continuous batching, across the stages of a plan.

Start reading at dsaflow/serve/reference.py: `prefill`, `decode_one_token` and `generate` in plain torch over the
same stage modules and caches, which give this engine's tokens (tests/test_serve_reference.py). `PipelineEngine._tick`
is one tick of this rank in the same words: pick a pass, run this rank's stages of the passes in flight, sample on the
last stage, exchange with the neighbours, hand the pass that left the pipeline back to the scheduler.

The cache rows [0, serve.max_batch) are split into serve.microbatches groups (default: the number of pipeline ranks),
each a contiguous row range with its own slice of every stage's caches and its own index slot. A pass is one forward
of one group through every stage (built by dsaflow.serve.scheduler), and the pipeline schedule
(dsaflow.pipeline.ticks) moves passes through the stages in ticks: stage s runs group g while stage s+1 runs group
g-1. The last stage samples the group's next tokens and sends them, with one EOS flag per row ([rows, 2] int64), to
stage 0's rank, which feeds them into the group's next pass, and with serve.eos_id set to every rank.

Every rank runs the same scheduler over the same requests, so all ranks build the same passes. Per pass no host sync:
positions and prompt tokens are host-known (one copy from pinned memory, `_upload`), decode tokens are swapped in on
the device, sampling is branchless and keyed by (request, token index), tokens accumulate on the device and reach the
host once at the end. Which rows emitted EOS (serve.eos_id) reaches the hosts one pass of the group late
(dsaflow/serve/eos.py).

A stage with a decode / prefill / mixed graph block replays CUDA graphs of its `forward_decode` / `forward_prefill`
through the GraphManager (dsaflow/serve/graph_manager.py): one graph per group and shape class (the group's cache rows
are baked into its graph), decode passes padded to the smallest class >= the group's active rows, prefill passes at
the group's full rows (or, with continuous batching, over the group's top rows) padded along tokens, mixed passes
(serve.max_pass_tokens) padded along tokens to a token-count class. The last stage's decode graphs sample too (their
output is the [rows, 2] message). With graphs.transfers, the transfers of decode ticks are replayed from graphs of
their own (dsaflow/pipeline/transfer_graphs.py), every pass's activations and message padded to the decode class of
its rows, so that a tick's transfers recur; a stage narrows what it receives back to the pass's rows.

With pipeline.cross_stage_indices, a stage that opens on S reads the top-k indices of the previous stage's last F
layer: they travel with the hidden state (int32 [rows, T, topk], the pass's `extra`) and are copied into the group's
static index buffer outside any graph, where the stage's S layers (eager or replayed) read them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from array import array
from itertools import chain
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dsaflow.model import dense_prefill
from dsaflow.model.cache import StageCache
from dsaflow.pipeline.p2p import post_tick
from dsaflow.pipeline.stages import stage_cache
from dsaflow.pipeline.ticks import PipelineSchedule, Timeline
from dsaflow.pipeline.transfer_graphs import TransferGraphs
from dsaflow.plan.plan import Plan

from .checks import check_graph_blocks, check_mixed_passes, requests_of, serve_groups
from .eos import LateFlags
from .graph_manager import GraphManager, StageGraphSpec, choose_shape_class, register_stage_graphs, sync_error_guard
from .mixed import pad_mixed_pass
from .passes import Pass, PassInputs, Request
from .report import CaptureReport, run_stats
from .sampling import TOKEN_KEY, sample_message
from .scheduler import Scheduler, group_ranges, online_arrivals, prefill_row_classes
from .speculative_engine import EngineSpeculation, check_speculation

NO_GUARD = contextlib.nullcontext()
plan_prefill = dense_prefill.plan_prefill  # the engine's one call into the short-prefill rule (tests spy on it)


class PipelineEngine:
    """Serving state of one rank: its stage modules, their caches (split into groups), its graph manager.

    stages: {stage index: StageModule} for the stages this rank owns (already on `device`, in `dtype`, eval mode);
    given every stage of the plan, the engine runs the whole pipeline in this process (tests, one-GPU benchmarks).
    link: a `StageLink` when stages live on other ranks, else None (all stages local).
    peer: pipeline rank -> global rank, the address `link` sends to (identity by default). With serving replicas
    (parallel.dp > 1) each replica's pipeline runs on its own global ranks (`RunContext.global_rank`); `rank` stays
    the pipeline rank, and reports and logs name the global rank.
    """

    def __init__(
        self,
        model_cfg,
        plan: Plan,
        stages: Dict[int, nn.Module],
        serve_cfg,
        graphs_cfg,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        link=None,
        force_eager: bool = False,
        capturer=None,
        peer: Optional[Callable[[int], int]] = None,
        per_request_sampling: bool = False,
    ):
        self.peer = peer or (lambda r: r)
        self.model_cfg, self.plan, self.stages, self.serve = model_cfg, plan, stages, serve_cfg
        self.device, self.dtype, self.rank, self.link = torch.device(device), dtype, rank, link
        check_graph_blocks(plan, serve_cfg)
        check_mixed_passes(serve_cfg, plan)
        check_speculation(model_cfg, serve_cfg, plan)
        # stage -> rank that runs it; when this process was handed every stage, it runs them all locally
        local_all = len(stages) == plan.num_stages
        self.owner = {s.index: (rank if local_all else s.rank) for s in plan.stages}
        self.first, self.last = 0, plan.num_stages - 1
        self.cross_stage = bool(plan.index_boundaries)  # indices travel with the hidden state at those boundaries
        self.receives = {s: plan.receives_indices(s) for s in stages}  # known at start: never asked per tick
        self.groups = serve_groups(serve_cfg, plan)
        self.ranges = group_ranges(serve_cfg.max_batch, self.groups)
        self.caches = self._allocate_caches(model_cfg, serve_cfg, stages)
        k = serve_cfg.speculative_tokens
        self.speculation = (
            EngineSpeculation(k, self.ranges, self.device, serve_cfg.eos_id, serve_cfg.max_context) if k else None
        )
        self.group_caches = {s: [c.rows(a, b) for a, b in self.ranges] for s, c in self.caches.items()}
        self.graphs = GraphManager(
            self.device,
            cache=graphs_cfg.cache,
            on_failure=graphs_cfg.on_failure,
            force_eager=force_eager,
            capturer=capturer,
            rank=self.peer(rank),  # its messages and graphs_rank<r>.json name the global rank
        )
        # per_request_sampling (`dsaflow serve`): each row samples with its request's own temperature, top_p and
        # seed, [rows, 3] keys (dsaflow.serve.sampling.sample_rowwise); key_ids[request] is then a (key, temperature
        # bits, top_p bits) triple
        self.rowwise = per_request_sampling
        self.keyed = serve_cfg.temperature > 0 or self.rowwise  # sampling reads each row's key (request, token index)
        # the last stage's sampling: (logits [rows, V], keys) -> (message [rows, 2], fp32 logits)
        sampling = {k: getattr(serve_cfg, k) for k in ("temperature", "top_p", "seed", "eos_id")}
        if self.rowwise:  # each request brings its own; a pass without keys (eager, every row greedy) takes argmax
            sampling["temperature"] = 0.0
        self._sample_logits = functools.partial(sample_message, **sampling)
        self._shape_classes(plan, serve_cfg, graphs_cfg)
        self.graph_names = {s: self._register_graphs(s) for s in stages}  # (kind, group, path) -> graph name
        self.last_graphs = bool(self.graph_names.get(self.last))  # this rank replays graphs of the last stage
        self.transfers: Optional[TransferGraphs] = None  # built at the first generate on a rank with a link
        self.transfer_capturer = None  # TransferGraphs' capturer (tests inject one; default: CUDA)
        self.record_logits = False
        # strict_sync: run every decode pass and mixed graph pass under torch.cuda.set_sync_debug_mode("error")
        # (proof of no host sync; needs graphs.cache=true, since a fresh capture syncs by design)
        self.strict_sync = False
        self.logits_log: Dict[int, List[torch.Tensor]] = {}  # last stage, record_logits: request -> [V] per token
        self.timings: Dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
        self.stats: Dict[str, object] = {}
        self.on_finished: Optional[Callable[[int, int], None]] = None  # last rank: (requests done, tokens so far)
        # every rank, as each pass leaves the pipeline: (pass, message [rows, 2] or None, requests that ended there);
        # online serving streams tokens from it (dsaflow.serve.online)
        self.on_pass: Optional[Callable] = None
        self.picked: Optional[torch.Tensor] = None  # the last stage's fp32 logits [rows, V] of the latest sample

    # --- setup -------------------------------------------------------------------------------------------------
    def _allocate_caches(self, model_cfg, serve_cfg, stages) -> Dict[int, StageCache]:
        """Every local stage's serving caches in serve.kv_dtype. The index slot holds one forward's tokens: a prefill
        chunk's per row, a mixed pass's (max_pass_tokens) or a verify pass's (K + 1); with speculative decoding the
        last stage also caches its MTP layers' rows."""
        k = serve_cfg.speculative_tokens
        tokens = max(serve_cfg.prefill_chunk, serve_cfg.max_pass_tokens or 0, k + 1)
        sizes = (serve_cfg.max_batch, serve_cfg.max_context, tokens, self.device, self.dtype, str(serve_cfg.kv_dtype))
        return {s: stage_cache(model_cfg, self.plan, s, *sizes, k > 0 and s == self.last) for s in stages}

    def _shape_classes(self, plan: Plan, serve_cfg, graphs_cfg) -> None:
        """The shape classes passes are padded to, from the plan's graph blocks."""
        # prefill graphs have a static row count: prefill passes then run every row of the group (on every rank)
        self.prefill_graphs = any(b.kind == "prefill" for b in plan.graph_blocks)
        # serve.short_prefill: the attention path of each prefill pass, from its host positions (no device read)
        self.prefill_paths = dense_prefill.PATHS if serve_cfg.short_prefill else ("sparse",)
        self.prefill_rule = dict(
            max_keys=dense_prefill.masked_max_keys(self.model_cfg), min_tokens=dense_prefill.MIN_PREFILL_TOKENS
        )
        # continuous batching: refills pack the group's rows and prefill its top rows (dsaflow.serve.scheduler,
        # "narrow"); with prefill graphs, through graphs over the top c rows for each of `row_classes`
        self.continuous = str(serve_cfg.batching) == "continuous"  # serve.batching
        group_rows = min(b - a for a, b in self.ranges)
        self.row_classes = prefill_row_classes(group_rows) if self.continuous and self.prefill_graphs else ()
        prefill_blocks = [b for b in plan.graph_blocks if b.kind == "prefill"] if self.row_classes else []
        # the token classes of the prefill graphs: a continuous prefill pass picks one (Scheduler._chunk_for)
        self.chunk_classes = tuple(prefill_blocks[0].shape_classes) if prefill_blocks else ()
        # the token classes of the mixed graphs: a mixed pass pads to the smallest class that holds it (mixed.py)
        self.mixed_classes = next((tuple(b.shape_classes) for b in plan.graph_blocks if b.kind == "mixed"), ())
        # graphs.transfers: decode ticks' transfers replayed from CUDA graphs, padded to the decode block's classes
        decode_blocks = [b for b in plan.graph_blocks if b.kind == "decode"]
        self.transfer_classes = tuple(decode_blocks[0].shape_classes) if graphs_cfg.transfers and decode_blocks else ()

    def _register_graphs(self, stage: int) -> Dict[Tuple[str, int, str], str]:
        spec = StageGraphSpec(
            first=stage == self.first,
            last=stage == self.last,
            dim=self.model_cfg.dim,
            dtype=self.dtype,
            sample=self._sample_logits,
            keyed=self.keyed,
            receives_indices=self.receives[stage],
            prefill_paths=tuple(self.prefill_paths),
            prefill_rule=self.prefill_rule,
            row_classes=tuple(self.row_classes),
            groups=self.groups,
            key_width=3 if self.rowwise else 1,
        )
        blocks = self.plan.blocks_of_stage(stage)
        return register_stage_graphs(self.graphs, stage, self.stages[stage], self.group_caches[stage], blocks, spec)

    def _on_device(self):
        """Device guard: every kernel (eager Triton launches included) runs on this rank's device."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.no_grad()
    def capture(self) -> CaptureReport:
        """Capture every requested block of this rank (at setup), check none is missing, reset the caches."""
        with self._on_device():
            report = self.graphs.capture_all()
        for c in self.caches.values():
            c.reset()
        return report

    # --- generation --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: List[List[int]],
        max_new: Optional[List[int]] = None,
        key_ids: Optional[List[int]] = None,
        arrivals: Optional[List[float]] = None,
    ) -> Optional[List[List[int]]]:
        """Token-id prompts (and optional per-request limits, default serve.max_new_tokens) -> generated token ids
        per prompt, in input order, on the last stage's rank (None on the others). Sets `stats` (per-request time to
        first token and time per output token, per-rank busy fractions) and `timings`. key_ids: the id each
        request's sampling is keyed by (default its position here): a serving replica passes the request's index in
        the whole job, so that sampled tokens do not depend on which replica served it. arrivals: online serving
        (`scheduler.online_arrivals`), request i joins arrivals[i] s after the start and its TTFT counts from then;
        default: all at the start. The tokens do not depend on it."""
        self.key_ids = list(key_ids) if key_ids is not None else list(range(len(prompts)))
        is_last = self.owner[self.last] == self.rank
        if not prompts:
            return [] if is_last else None
        max_new = list(max_new) if max_new is not None else [self.serve.max_new_tokens] * len(prompts)
        requests = requests_of(prompts, max_new, self.serve.max_context, self.model_cfg.vocab_size)
        self.arrivals = online_arrivals(arrivals, len(prompts), len(set(self.owner.values())) == 1)
        self.scheduler = self._scheduler(requests)
        self.logits_log, self.first_mark, self.last_mark = {}, {}, {}
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
        for c in self.caches.values():
            c.reset()
        with self._on_device():
            self._start_run(len(prompts), max(max_new), is_last)
            self.scheduler.start_clock()
            self.timeline.begin()
            t = 0
            while self._tick(t):
                t += 1
            self.timeline.end = self.timeline.mark()
            tl = self.timeline.resolve()
        self._summarise(tl, t, requests)
        if not is_last:
            return None
        tokens = self.out_tokens.tolist()  # the one device -> host copy of the tokens
        return [tokens[r.index][: self.scheduler.generated[r.index]] for r in requests]

    def _scheduler(self, requests: List[Request], kind=Scheduler) -> Scheduler:
        """The run's scheduler, of class `kind` (online serving passes its subclass)."""
        s = self.serve
        return kind(
            requests,
            self.ranges,
            s.prefill_chunk,
            refill=self.continuous,
            mixed=self.prefill_graphs and not self.continuous,
            narrow=self.continuous,
            chunk_classes=self.chunk_classes,
            max_pass_tokens=s.max_pass_tokens,
            # groups share ticks only across ranks; eager passes cost their rows x tokens on a CPU (launches on a GPU)
            balance=self.groups > 1 and len(set(self.owner.values())) > 1 and self.device.type == "cpu",
            arrivals=self.arrivals,
            speculative_tokens=s.speculative_tokens,
        )

    def _start_run(self, requests: int, out_width: int, is_last: bool) -> None:
        """The run's device buffers, schedule and timeline. out_width 0: no output buffer (online serving streams
        each pass's tokens through `on_pass` instead)."""
        s = self.serve
        keep = is_last and out_width > 0
        self.out_tokens = torch.zeros(requests, out_width, dtype=torch.long, device=self.device) if keep else None
        self.last_tokens = [torch.zeros(b - a, dtype=torch.long, device=self.device) for a, b in self.ranges]
        self.out_width = out_width  # out_tokens [requests, out_width]
        self.row_ids = torch.arange(max(b - a for a, b in self.ranges), device=self.device)
        # a decode pass uploads at most 8 ints per row (`pass_vectors`); longer prefill passes take their own buffer
        self.uploader = Uploader(self.device, 8 * len(self.row_ids) + 64, stages=self.plan.num_stages)
        # the feedback: stage 0's rank feeds the tokens back in; the others read only the EOS flags
        # with speculation every rank reads how far each row advanced (dsaflow.serve.speculative_engine)
        feedback = None if s.eos_id is not None or self.speculation else [self.owner[self.first]]
        self.schedule = PipelineSchedule(
            self.owner, self.rank, self.peer, carries=self.plan.sends_indices, feedback_ranks=feedback
        )
        if len(self.schedule.segments) > 1 and self.link is None:
            raise ValueError("PipelineEngine: stages live on several ranks but no link was given.")
        self.timeline = Timeline(self.device, len(self.schedule.segments))
        self.transfers = self._transfer_graphs()
        late = s.eos_id is not None and self.speculation is None  # speculation reads EOS with the tokens, at once
        self.late_eos = LateFlags(self.device, [b - a for a, b in self.ranges]) if late else None
        if self.speculation is not None:
            self.speculation.start_run()
        self.hold_ticks = s.max_ticks_ahead if self.device.type == "cuda" else None  # `Timeline.hold_back`
        self.first_here, self.last_here = self.first in self.stages, self.last in self.stages
        self._post = functools.partial(post_tick, self.link, device=self.device)  # a tick's transfers, eagerly
        self.sync_checked = self.strict_sync and self.device.type == "cuda"

    # --- one tick ----------------------------------------------------------------------------------------------
    def _tick(self, t: int) -> bool:
        """Tick t of this rank -> False once no pass is left. Every rank walks the same ticks: segment j of the
        pipeline runs the pass that started j ticks ago (dsaflow.pipeline.ticks)."""
        schedule, timeline, clock = self.schedule, self.timeline, time.perf_counter
        if self.hold_ticks is not None:
            timeline.hold_back(self.hold_ticks)  # before picking: what it schedules sees the latest arrivals
        h0 = clock()
        p = self.scheduler.pick(schedule.busy_groups)  # which rows, which tokens: host-known, the same on every rank
        if p is None and not schedule.in_flight:
            return False
        work = schedule.begin(t, None if p is None else self._prepare(p))  # which pass each of my segments runs now
        h1 = clock()
        decode = timeline.tick_start(schedule.decoding)
        outputs, message = [], None
        for j, q, x in work:  # x: what the segment received, None on stage 0 (it reads its tokens)
            span = timeline.span_start()
            # decode passes and mixed graph passes run with host syncs raising, under `strict_sync` on a GPU
            checked = self.sync_checked and (q.decode_only or q.token_major and q.graph)
            with sync_error_guard(True) if checked else NO_GUARD:
                for stage in schedule.segments[j][1]:
                    x = self._forward(q, stage, x)
                if j == schedule.K - 1:
                    x = message = self._sample(q, x)
            end = timeline.span_end(span, decode)
            if j == schedule.K - 1:
                q.finished_at = end
            outputs.append((j, q, x))
        h2 = clock()
        # activations to the next segments' ranks and the last stage's message to the ranks that read it, posted
        # together with the receives of the next tick (decode ticks replay them from graphs with graphs.transfers)
        ops, keys = schedule.transfers(t, outputs, message)
        if ops:
            post = self.transfers if decode and self.transfers is not None else self._post
            message = schedule.deliver(keys, post(ops), message)
        kind = "decode" if decode else "mixed" if schedule.any_token_major() else "prefill"
        timeline.tick_end(decode, kind)
        h3 = clock()
        done = schedule.leave(t)
        if done is not None:
            self._finish(done, message)
        if decode:
            timeline.count_host(h0, h1, h2, h3, clock())
        return True

    def _forward(self, p: Pass, stage: int, x):
        """One stage of one pass -> its output; with cross-stage indices, (output, the indices the next stage reads)
        for every stage but the last. x: the previous stage's output (a tuple with indices likewise), None on
        stage 0 (it reads the pass's tokens and the group's previous tokens)."""
        indices = None
        if isinstance(x, tuple):
            x, indices = x
        if x is not None and x.shape[0] != p.rows and not p.token_major:  # padded to a transfer class
            x, indices = x[: p.rows], (None if indices is None else indices[: p.rows])
        v, cache = p.inputs, self.group_caches[stage][p.group]
        if stage == self.first:
            x = self._first_input(p, v)
        if p.moves:  # a refill compacted the group: its rows move on this stage before the pass
            cache.move_rows(v.move_from, v.move_to, p.move_len)
        kind = "decode" if p.decode_only else "mixed" if p.token_major else "prefill"
        name = self.graph_names[stage].get((kind, p.group, p.path)) if p.graph else None
        if name is not None and kind == "prefill" and self.row_classes and p.rows < cache.max_batch:
            name = f"{name}/r{p.rows}"  # the graph over the group's top p.rows rows
        if p.row0 > 0:  # a pass over some rows of the group: a view of just those rows
            cache = cache.rows(p.row0, p.row0 + p.rows)
        R, T = v.positions.shape
        received = None
        if self.receives[stage]:
            received = cache.index[:R, :T]
            received.copy_(indices)  # outside any graph: the stage's S layers read this buffer
        module = self.stages[stage]
        if name is not None:  # a mixed pass arrives padded to its class (`_prepare`), so n is the class
            n = x.shape[0] if kind == "decode" else x.shape[1]
            keys = {"keys": v.keys} if kind == "decode" and stage == self.last and self.keyed else {}
            rows = {"token_rows": v.token_rows} if p.token_major else {}
            out = self.graphs.run(name, stage, n, {"x": x, "positions": v.positions, **keys, **rows})
        elif p.decode_only:
            out = module.forward_decode(x, v.positions, cache, indices_in=received)
        else:
            out = module.forward_prefill(
                x, v.positions, cache, indices_in=received, hint=p.hint, token_rows=v.token_rows
            )
        if self.cross_stage and stage != self.last:
            return out, cache.index[:R, :T]
        return out

    def _first_input(self, p: Pass, v: PassInputs) -> torch.Tensor:
        """Stage 0's input: the pass's token ids, each decoding row's previous sampled token swapped in on the
        device (no host sync)."""
        last = self.last_tokens[p.group]
        if p.moves:
            last.index_copy_(0, v.move_to, last.index_select(0, v.move_from))
        last = last[p.row0 : p.row0 + p.rows]
        if p.decode_only:  # every row decodes or idles (position -1, its token is moot): a view, no copy
            return last.view(p.rows, 1)
        x = v.tokens
        if p.token_major:  # a mixed pass: the decoding rows' previous tokens go to their columns
            x.view(-1).index_copy_(0, v.swap_cols, last.index_select(0, v.swap_rows))
        elif v.decode is not None:  # prompt chunks; the decoding rows of a mixed pass feed their previous token
            x[:, 0] = torch.where(v.decode.bool(), last, x[:, 0])
        return x if self.speculation is None else self.speculation.first_input(p, v, x)

    def _sample(self, p: Pass, out) -> torch.Tensor:
        """Last stage: sample every emitting row -> [rows, 2] int64 (tokens, EOS flags). out: the last stage's
        logits [rows, T, V], or what its decode graph sampled (`sample_message`'s pair)."""
        v = p.inputs
        if isinstance(out, tuple):  # sampled inside the decode graph
            message, picked = out
        else:  # logits [rows, T, V]: each row samples from its own column (a decode pass has one)
            if p.token_major:  # [1, T, V]: row r samples from its column cols[r]
                logits = out[0].index_select(0, v.cols)
            else:
                logits = out[:, 0] if p.T == 1 else out[self.row_ids[: p.rows], v.cols]
            message, picked = self._sample_logits(logits, v.keys)
        self.picked = picked
        if p.emit and self.out_tokens is not None:
            tok = message[:, 0]
            emitted = tok.index_select(0, v.emit_rows) if v.emit_rows is not None else tok
            self.out_tokens.view(-1).index_copy_(0, v.emit_slots, emitted)
        if self.record_logits:
            for r, _, req, _ in p.emit:
                self.logits_log.setdefault(req, []).append(picked[r].clone())
        if self.speculation is not None:  # verify the drafts, draft the next ones: the [rows, 2k + 4] message
            cache = self.group_caches[self.last][p.group]
            cache = cache.rows(p.row0, p.row0 + p.rows) if p.row0 > 0 else cache
            rows = self.scheduler.rows[p.group]
            message = self.speculation.after_sample(self.stages[self.last], cache, p, out, message, rows)
        return message

    def _finish(self, p: Pass, message: Optional[torch.Tensor]) -> None:
        """Every rank: the pass is through. Stage 0's rank keeps the tokens; everyone advances the scheduler. message
        ([rows, 2]: tokens, EOS flags) reaches stage 0's rank always, and the other ranks only with serve.eos_id."""
        message = None if message is None else message[: p.rows]  # padded to a transfer class (graphs.transfers)
        if self.first_here and p.emit:  # only rows that sampled: a prefill pass may span decoding rows
            fed_from, last = p.inputs.fed_from, self.last_tokens[p.group][p.row0 : p.row0 + p.rows]
            if fed_from is not None:
                last.index_copy_(0, fed_from, message[:, 0].index_select(0, fed_from))
            else:  # every row of the pass sampled, in order
                last.copy_(message[:, 0])
        late = self.late_eos.take(p.group) if self.late_eos else None  # the group's previous pass (eos.py)
        done = self.scheduler.end(*late) if late else []
        if self.speculation is not None:  # each row's tokens of the pass, read from the message
            done += self.speculation.finish(self, p, message)
        else:
            done += self.scheduler.finish(p)  # drops the tokens of rows that just ended (p.emit keeps the rest)
        if self.late_eos and p.emit:
            self.late_eos.put(p.group, p, message)
        if p.finished_at is not None:  # the last stage's rank: when the pass was sampled
            for _, _, req, k in p.emit:
                if k == 0:
                    self.first_mark[req] = p.finished_at
                self.last_mark[req] = p.finished_at
        self.timings["tokens"] += len(p.emit)
        self.timings["decode_steps"] += int(p.decode_only or p.speculative)
        if done and self.on_finished is not None and self.owner[self.last] == self.rank:
            self.on_finished(self.scheduler.finished, int(self.timings["tokens"]))
        if self.on_pass is not None:
            self.on_pass(p, message, done)

    # --- a pass, ready to run ----------------------------------------------------------------------------------
    def _prepare(self, p: Pass) -> Pass:
        """Fill in what running a scheduled pass needs: whether it replays graphs, its padding, its prefill path,
        its device tensors and what travels between stages. Decode passes replay the decode graphs; with prefill
        graphs, a prefill pass of fixed batches is mixed (the scheduler's `mixed`) and replays the group's prefill
        graph padded to its rows, and one of continuous batching replays the smallest top-row graph that holds it,
        padded below (an eager pass of a few rows costs ~30 ms of launches for model=small on an H200); without, it
        runs eagerly on its rows."""
        graph = p.decode_only or self.scheduler.mixed or bool(self.row_classes)
        if p.token_major:  # padded on the host, so every stage, transfer and graph sees the class's [1, c] shapes
            graph = bool(self.mixed_classes)
            if graph:
                pad_mixed_pass(p, choose_shape_class(self.mixed_classes, p.T))
        elif not p.decode_only and self.scheduler.mixed:
            p.pad_rows(self.ranges[p.group][1] - self.ranges[p.group][0])
        elif not p.decode_only and self.row_classes:  # top-aligned: the smallest class of top rows that holds the pass
            p.pad_front(choose_shape_class(self.row_classes, p.rows))
        p.graph = graph
        if not p.decode_only and not p.token_major and "dense" in self.prefill_paths:
            topk, cache_rows = self.model_cfg.index_topk, self.serve.max_context + 1
            p.hint = plan_prefill(p.positions, topk, cache_rows, **self.prefill_rule)
            if graph and p.hint is not None and p.hint.path == "masked":
                p.hint = None  # no masked graphs (dense_prefill.graph_classes): the sparse graph replays
            p.path = dense_prefill.graph_label(p.hint, topk, cache_rows)
        keyed = int(self.keyed)
        if self.rowwise:  # a graph on the last stage always reads keys; else a pass of greedy rows needs none
            keyed = 3 if self.last_graphs or any(self.key_ids[e[2]][1] for e in p.emit) else 0
        vectors = pass_vectors(p, self.first_here, self.last_here, self.key_ids, self.out_width, keyed)
        p.inputs = PassInputs(**self.uploader(vectors))  # one host-to-device copy
        # what travels: with graphs.transfers a decode pass's rows padded to their class (the tick's shapes recur)
        rows = p.rows
        sent = choose_shape_class(self.transfer_classes, rows) if self.transfer_classes and p.decode_only else rows
        batch = 1 if p.token_major else sent  # a mixed pass's activations are [1, T, dim]; its message [rows, 2]
        width = 2 if self.speculation is None else self.speculation.width
        p.hidden, p.hidden_dtype, p.feedback = (batch, p.T, self.model_cfg.dim), self.dtype, (sent, width)
        p.extra = (((batch, p.T, self.model_cfg.index_topk), torch.int32),) if self.cross_stage else ()
        return p

    def _transfer_graphs(self) -> Optional[TransferGraphs]:
        """The rank's TransferGraphs (graphs.transfers, kept across runs), or None."""
        if self.transfer_classes and self.link is not None and self.transfers is None:
            self.transfers = TransferGraphs(self.link, self.device, capturer=self.transfer_capturer)
        return self.transfers

    def _summarise(self, tl: Dict[str, float], ticks: int, requests: List[Request]) -> None:
        self.timings["prefill_s"] = tl["wall_s"] - tl["decode_wall_s"]
        self.timings["decode_s"] = tl["decode_wall_s"]
        done = {r.index: self.scheduler.generated[r.index] for r in requests}
        ttft, tpot = self.timeline.latencies(self.first_mark, self.last_mark, done)
        self.stats = run_stats(tl, ticks, (self.scheduler.from_arrival(ttft), tpot), int(self.timings["tokens"]))
        if self.speculation is not None:
            self.stats["speculation"] = self.speculation.summary()


def pass_vectors(
    p: Pass, first: bool, last: bool, key_ids, out_width: int, keyed: int
) -> List[Tuple[str, List[int], Tuple[int, ...]]]:
    """[(name, host ints, shape)] of every `PassInputs` tensor a rank reads for pass p: `first` / `last`, whether
    it runs stage 0 / the last stage; key_ids[request]: the id its sampling is keyed by (keyed=3: a (key id,
    temperature bits, top_p bits) triple); out_width: the output tokens' row length (0: no output buffer); keyed:
    0 = sampling reads no keys (greedy), 1 = keys [rows] (temperature > 0), 3 = per-request sampling, keys
    [rows, 3]. A shape (-1,) is the vector's length."""
    rows, T = p.rows, p.T
    shape = (1, T) if p.token_major else (rows, T)
    vectors: List[Tuple[str, List[int], Tuple[int, ...]]] = [
        ("positions", list(chain.from_iterable(p.positions)), shape)
    ]
    if p.token_major:
        vectors.append(("token_rows", list(p.token_rows), shape))
    if p.moves:
        vectors += [("move_from", [a for a, _ in p.moves], (-1,)), ("move_to", [b for _, b in p.moves], (-1,))]
    emitted = [e[0] for e in p.emit]
    every_row = emitted == list(range(rows))
    if first:
        if not p.decode_only:
            vectors.append(("tokens", list(chain.from_iterable(p.tokens)), shape))
        if p.token_major:
            swaps = [(c, r) for r, c, _, _ in p.emit if p.decode[r]]
            vectors += [("swap_cols", [c for c, _ in swaps], (-1,)), ("swap_rows", [r for _, r in swaps], (-1,))]
        elif not p.decode_only and any(p.decode):
            vectors.append(("decode", [int(d) for d in p.decode], (-1,)))
        if not every_row:
            vectors.append(("fed_from", emitted, (-1,)))
    if last:
        if T > 1 or p.token_major:  # a mixed pass of one token still samples through cols
            cols = [0] * rows
            for r, c, _, _ in p.emit:
                cols[r] = c
            vectors.append(("cols", cols, (-1,)))
        if keyed == 1:  # each emitting row's key (request, token index); the others' are moot
            keys = [0] * rows
            for r, _, req, k in p.emit:
                keys[r] = key_ids[req] * TOKEN_KEY + k
            vectors.append(("keys", keys, (-1,)))
        elif keyed == 3:  # and its request's temperature and top_p (float64 bits); idle rows: 0, 0 = greedy
            keys = [0] * (3 * rows)
            for r, _, req, k in p.emit:
                key, temperature, top_p = key_ids[req]
                keys[3 * r : 3 * r + 3] = (key * TOKEN_KEY + k, temperature, top_p)
            vectors.append(("keys", keys, (rows, 3)))
        if not every_row and out_width:
            vectors.append(("emit_rows", emitted, (-1,)))
        if out_width:
            vectors.append(("emit_slots", [req * out_width + k for _, _, req, k in p.emit], (-1,)))
    return vectors


def h2d(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints -> a device int64 tensor without a host sync (pinned memory, non-blocking copy on GPU)."""
    t = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Uploader:
    """One host-to-device copy per pass, through buffers allocated once: on a GPU a ring of `slots` pinned staging
    slots and as many device slots, each `slot_ints` int64 long. Called with [(name, ints, shape)] -> {name: a
    device int64 view of that shape (-1: its length)} of one buffer.

    Why: a decode pass of `model=small` replays one CUDA graph per stage, so the host work around it decides whether
    a rank keeps its GPU fed; about ten small tensors per pass, each with its own pinned buffer and copy, held a
    host-bound configuration to under half its rate, and a fresh pinned buffer per pass costs about 0.1 ms of host
    time (an H200 machine). Reuse is safe because (1) before a pinned slot is overwritten, the host waits for the
    event recorded after its last copy (it waits only when it runs more than `slots` passes ahead of its GPU, which
    then still has that many queued), and (2) a device slot is rewritten by a copy on the same stream as every
    kernel that read it, so after them; a pass's views are read while it is in flight, at most one pass per stage,
    so `slots` must exceed the number of stages (checked). A pass whose ints do not fit a slot (a long prefill
    chunk) takes its own pinned buffer (`h2d`). On CPU: a tensor over the packed ints."""

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

    def __call__(self, vectors: Sequence[Tuple[str, Sequence[int], Tuple[int, ...]]]) -> Dict[str, torch.Tensor]:
        flat: List[int] = []
        spans = []
        for name, values, shape in vectors:
            spans.append((name, len(flat), len(values), shape))
            flat.extend(values)
        n = len(flat)
        if not self.cuda:
            buf = torch.tensor(flat, dtype=torch.long)
        elif n > self.slot_ints or n == 0:
            buf = h2d(flat, self.device)
        else:
            i = self.next
            self.next = (i + 1) % self.slots
            self.copied[i].synchronize()  # the slot's previous copy has left its pinned memory
            a = i * self.slot_ints
            values = array("q", flat)
            ctypes.memmove(self.host.data_ptr() + 8 * a, values.buffer_info()[0], 8 * n)
            buf = self.dev[a : a + n]
            buf.copy_(self.host[a : a + n], non_blocking=True)
            self.copied[i].record(self.stream)
        return {name: buf[a : a + k].view(shape) for name, a, k, shape in spans}
