"""Pipeline inference engine: microbatch groups in flight, continuous batching, across the stages of a plan.

Start reading at dsaflow/serve/reference.py: `prefill`, `decode_one_token` and `generate` in plain torch over the
same stage modules and caches, which give this engine's tokens (tests/test_serve_reference.py). What follows adds
the pipeline, the groups, the refills and the CUDA graphs.

The cache rows [0, serve.max_batch) are split into serve.microbatches groups (default: the number of pipeline ranks),
each a contiguous row range with its own slice of every stage's caches and its own index slot. A pass is one forward
of one group through every stage (built by dsaflow.serve.scheduler), and the pipelined executor
(dsaflow.pipeline.executor) moves passes through the stages in ticks: stage s runs group g while stage s+1 runs group
g-1. The last stage samples the group's next tokens and sends them, with one EOS flag per row ([rows, 2] int64), to
stage 0's rank, which feeds them into the group's next pass, and with serve.eos_id set to every rank.

Every rank runs the same scheduler over the same requests, so all ranks build the same passes. Per pass no host sync:
positions and prompt tokens are host-known (copied from pinned memory), decode tokens are swapped in on the device,
sampling is branchless and keyed by (request, token index), tokens accumulate on the device and reach the host once
at the end. Which rows emitted EOS (serve.eos_id) reaches the hosts one pass of the group late (dsaflow/serve/eos.py).

A stage with a decode / prefill graph block runs through the GraphManager: one graph per group and shape class (the
group's cache rows are baked into its graph), decode passes padded to the smallest class >= the group's active rows,
prefill passes run at the group's full rows and padded along tokens, mixed passes (serve.max_pass_tokens with a mixed
block, graphs=decode_mixed) padded along tokens to a token-count class. The last stage's decode graphs sample too
(their output is the [rows, 2] message). With graphs.transfers, the transfers of decode ticks are replayed from
graphs of their own (dsaflow/pipeline/transfer_graphs.py), every pass's activations and message padded to the decode
class of its rows, so that a tick's transfers recur; a stage narrows what it receives back to the pass's rows.

With pipeline.cross_stage_indices, a stage that opens on S reads the top-k indices of the previous stage's last F
layer: they travel with the hidden state (int32 [rows, T, topk], the executor's `extra`) and are copied into the
group's static index buffer outside any graph, where the stage's S layers (eager or replayed) read them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from dsaflow.model import dense_prefill
from dsaflow.pipeline import executor
from dsaflow.pipeline.executor import PipelineExecutor
from dsaflow.pipeline.stages import stage_cache
from dsaflow.pipeline.transfer_graphs import TransferGraphs
from dsaflow.plan.plan import Plan

from .checks import check_graph_blocks, check_mixed_passes, requests_of, serve_groups
from .eos import LateFlags
from .graph_manager import GraphManager, choose_shape_class, sync_error_guard
from .mixed import pad_mixed_pass
from .passes import Pass, Request
from .report import CaptureReport, run_stats
from .sampling import TOKEN_KEY, sample_message
from .scheduler import Scheduler, group_ranges, online_arrivals, prefill_row_classes
from .stage_graphs import GraphBlocks
from .upload import Uploader, pass_vectors

plan_prefill = dense_prefill.plan_prefill  # the engine's one call into the short-prefill rule (tests spy on it)


class PipelineEngine(GraphBlocks):
    """Serving state of one rank: its stage modules, their caches (split into groups), its graph manager and the
    pipelined executor.

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
    ):
        self.peer = peer or (lambda r: r)
        self.model_cfg, self.plan, self.stages, self.serve = model_cfg, plan, stages, serve_cfg
        self.device, self.dtype, self.rank, self.link = torch.device(device), dtype, rank, link
        check_graph_blocks(plan, serve_cfg)
        check_mixed_passes(serve_cfg, plan)
        # stage -> rank that runs it; when this process was handed every stage, it runs them all locally
        local_all = len(stages) == plan.num_stages
        self.owner = {s.index: (rank if local_all else s.rank) for s in plan.stages}
        self.first, self.last = 0, plan.num_stages - 1
        self.cross_stage = bool(plan.index_boundaries)  # indices travel with the hidden state at those boundaries
        self.groups = serve_groups(serve_cfg, plan)
        self.ranges = group_ranges(serve_cfg.max_batch, self.groups)
        self.batch_cap = serve_cfg.max_batch
        # the index slot holds one forward's tokens: a prefill chunk's per row, or a mixed pass's (max_pass_tokens)
        sizes = (
            serve_cfg.max_batch,
            serve_cfg.max_context,
            max(serve_cfg.prefill_chunk, serve_cfg.max_pass_tokens or 0),
        )
        self.caches = {s: stage_cache(model_cfg, plan, s, *sizes, self.device, dtype) for s in stages}
        self.group_caches = {s: [c.rows(a, b) for a, b in self.ranges] for s, c in self.caches.items()}
        self.graphs = GraphManager(
            self.device,
            cache=graphs_cfg.cache,
            on_failure=graphs_cfg.on_failure,
            force_eager=force_eager,
            capturer=capturer,
            rank=self.peer(rank),  # its messages and graphs_rank<r>.json name the global rank
        )
        # prefill graphs have a static row count: prefill passes then run every row of the group (on every rank)
        self.prefill_graphs = any(b.kind == "prefill" for b in plan.graph_blocks)
        # serve.short_prefill: the attention path of each prefill pass, from its host positions (no device read)
        self.prefill_paths = dense_prefill.PATHS if serve_cfg.short_prefill else ("sparse",)
        self.prefill_rule = dict(
            max_keys=dense_prefill.masked_max_keys(model_cfg), min_tokens=dense_prefill.MIN_PREFILL_TOKENS
        )
        self.blocks = {s: plan.blocks_of_stage(s) for s in stages}
        self.keyed = serve_cfg.temperature > 0  # sampling reads each row's key (request, token index)
        # the last stage's sampling: (logits [rows, V], keys) -> (message [rows, 2], fp32 logits)
        sampling = {k: getattr(serve_cfg, k) for k in ("temperature", "top_p", "seed", "eos_id")}
        self._sample = functools.partial(sample_message, **sampling)
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
        for s, blocks in self.blocks.items():
            for b in blocks:
                for g in range(self.groups):
                    self._register(s, b, g)
        # graphs.transfers: decode ticks' transfers replayed from CUDA graphs, padded to the decode block's classes
        decode_blocks = [b for b in plan.graph_blocks if b.kind == "decode"]
        self.transfer_classes = tuple(decode_blocks[0].shape_classes) if graphs_cfg.transfers and decode_blocks else ()
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

    # --- setup -------------------------------------------------------------------------------------------------
    def _on_device(self):
        """Device guard: every kernel (eager Triton launches included) runs on this rank's device."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _sync_guard(self, on: bool):
        return sync_error_guard(on and self.strict_sync and self.device.type == "cuda")

    @torch.no_grad()
    def capture(self) -> CaptureReport:
        """Capture every requested block of this rank (at setup), check none is missing, reset the caches."""
        with self._on_device():
            report = self.graphs.capture_all()
        for c in self.caches.values():
            c.reset()
        return report

    # --- one stage of one pass -----------------------------------------------------------------------------------
    def _stage(self, pass_: executor.Pass, stage: int, x):
        """One stage of one pass -> its output; with cross-stage indices, (output, the indices the next stage reads)
        for every stage but the last. x: the previous stage's output (a tuple with indices likewise), None on
        stage 0."""
        indices = None
        if isinstance(x, tuple):
            x, indices = x
        p: Pass = pass_.payload
        if x is not None and x.shape[0] != p.rows and not p.token_major:  # padded to a transfer class
            x, indices = x[: p.rows], (None if indices is None else indices[: p.rows])
        with self._sync_guard(pass_.decode or p.token_major and p.graph):
            v = p.dev
            if stage == self.first:
                last = self.last_tokens[p.group]
                if p.moves:
                    last.index_copy_(0, v["move_to"], last.index_select(0, v["move_from"]))
                last = last[p.row0 : p.row0 + p.rows]
                if p.decode_only:  # every row decodes or idles (position -1, its token is moot): a view, no copy
                    x = last.view(p.rows, 1)
                elif p.token_major:  # a mixed pass: the decoding rows' previous tokens go to their columns
                    x = v["tokens"]
                    x.view(-1).index_copy_(0, v["swap_cols"], last.index_select(0, v["swap_rows"]))
                else:  # prompt chunks; the decoding rows of a mixed pass feed their previous token
                    x = v["tokens"]
                    if "decode" in v:
                        x[:, 0] = torch.where(v["decode"].bool(), last, x[:, 0])
            kind = "decode" if p.decode_only else "mixed" if p.token_major else "prefill"
            name = self._block_name(stage, kind, p.group, p.path) if p.graph else None
            cache = self.group_caches[stage][p.group]
            if p.moves:  # a refill compacted the group: its rows move on this stage before the pass
                cache.move_rows(v["move_from"], v["move_to"], p.move_len)
            if name is not None and kind == "prefill" and self.row_classes and p.rows < cache.max_batch:
                name = f"{name}/r{p.rows}"  # the graph over the group's top p.rows rows
            if p.row0 > 0:  # a pass over some rows of the group: a view of just those rows
                cache = cache.rows(p.row0, p.row0 + p.rows)
            positions = v["positions"]
            R, T = positions.shape
            if self.plan.receives_indices(stage):
                cache.index[:R, :T].copy_(indices)  # outside any graph: the stage's S layers read this buffer
            rows = {"token_rows": v["token_rows"]} if p.token_major else {}
            if name is None:
                received = self._received(stage, cache, positions)
                out = self.stages[stage](x, positions, cache, indices_in=received, prefill=p.hint, **rows)
            else:  # a mixed pass arrives padded to its class (`_prepare`), so n is the class and nothing pads here
                n = x.shape[0] if kind == "decode" else x.shape[1]
                keys = {"keys": v["keys"]} if kind == "decode" and stage == self.last and self.keyed else {}
                out = self.graphs.run(name, stage, n, {"x": x, "positions": positions, **keys, **rows})
            if self.cross_stage and stage != self.last:
                return out, cache.index[:R, :T]
            return out

    def _finish(self, pass_: executor.Pass, out) -> torch.Tensor:
        """Last stage: sample every emitting row -> [rows, 2] int64 (tokens, EOS flags). out: the last stage's
        logits [rows, T, V], or what its decode graph sampled (`sample_message`'s pair)."""
        p: Pass = pass_.payload
        with self._sync_guard(pass_.decode or p.token_major and p.graph):
            v = p.dev
            if isinstance(out, tuple):  # sampled inside the decode graph
                message, picked = out
            else:  # logits [rows, T, V]: each row samples from its own column (a decode pass has one)
                if p.token_major:  # [1, T, V]: row r samples from its column cols[r]
                    logits = out[0].index_select(0, v["cols"])
                else:
                    logits = out[:, 0] if p.T == 1 else out[self.row_ids[: p.rows], v["cols"]]
                message, picked = self._sample(logits, v.get("keys"))
            if p.emit:
                tok = message[:, 0]
                emitted = tok.index_select(0, v["emit_rows"]) if "emit_rows" in v else tok
                self.out_tokens.view(-1).index_copy_(0, v["emit_slots"], emitted)
            if self.record_logits:
                for r, _, req, _ in p.emit:
                    self.logits_log.setdefault(req, []).append(picked[r].clone())
            return message

    def _feedback(self, pass_: executor.Pass, message: Optional[torch.Tensor]) -> None:
        """Every rank: the pass is through. Stage 0's rank keeps the tokens; everyone advances the scheduler. message
        ([rows, 2]: tokens, EOS flags) reaches stage 0's rank always, and the other ranks only with serve.eos_id."""
        p: Pass = pass_.payload
        message = None if message is None else message[: p.rows]  # padded to a transfer class (graphs.transfers)
        if self.first in self.stages and p.emit:  # only rows that sampled: a prefill pass may span decoding rows
            v, last = p.dev, self.last_tokens[p.group][p.row0 : p.row0 + p.rows]
            if "fed_from" in v:
                last.index_copy_(0, v["fed_from"], message[:, 0].index_select(0, v["fed_from"]))
            else:  # every row of the pass sampled, in order
                last.copy_(message[:, 0])
        late = self.late_eos.take(p.group) if self.late_eos else None  # the group's previous pass (eos.py)
        done = self.scheduler.end(*late) if late else []
        done += self.scheduler.finish(p)  # drops the tokens of rows that just ended (p.emit keeps the rest)
        if self.late_eos and p.emit:
            self.late_eos.put(p.group, p, message)
        if pass_.finished_at is not None:  # the last stage's rank: when the pass was sampled
            for _, _, req, k in p.emit:
                if k == 0:
                    self.first_mark[req] = pass_.finished_at
                self.last_mark[req] = pass_.finished_at
        self.timings["tokens"] += len(p.emit)
        self.timings["decode_steps"] += int(p.decode_only)
        if done and self.on_finished is not None and self.owner[self.last] == self.rank:
            self.on_finished(self.scheduler.finished, int(self.timings["tokens"]))

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
        s = self.serve
        self.key_ids = list(key_ids) if key_ids is not None else list(range(len(prompts)))
        if not prompts:
            return [] if self.owner[self.last] == self.rank else None
        max_new = list(max_new) if max_new is not None else [s.max_new_tokens] * len(prompts)
        requests = requests_of(prompts, max_new, s.max_context, self.model_cfg.vocab_size)
        self.arrivals = online_arrivals(arrivals, len(prompts), len(set(self.owner.values())) == 1)
        self.scheduler = Scheduler(
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
        )
        self.logits_log, self.first_mark, self.last_mark = {}, {}, {}
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
        for c in self.caches.values():
            c.reset()
        with self._on_device():
            is_last = self.owner[self.last] == self.rank
            self.out_tokens = (
                torch.zeros(len(prompts), max(max_new), dtype=torch.long, device=self.device) if is_last else None
            )
            self.last_tokens = [torch.zeros(b - a, dtype=torch.long, device=self.device) for a, b in self.ranges]
            self.out_width = max(max_new)  # out_tokens [requests, out_width]
            self.row_ids = torch.arange(max(b - a for a, b in self.ranges), device=self.device)
            # a decode pass uploads at most 8 ints per row (pass_vectors); longer prefill passes take their own buffer
            self.upload = Uploader(self.device, 8 * len(self.row_ids) + 64, stages=self.plan.num_stages)
            # the feedback: stage 0's rank feeds the tokens back in; the others read only the EOS flags
            feedback = None if s.eos_id is not None else [self.owner[self.first]]
            self.executor = PipelineExecutor(
                self.owner,
                self.rank,
                self.link,
                self.device,
                self.peer,
                carries_extra=self.plan.sends_indices,
                feedback_ranks=feedback,
                decode_transfer=self._transfer_graphs(),
                max_ticks_ahead=s.max_ticks_ahead,
            )
            self.late_eos = LateFlags(self.device, [b - a for a, b in self.ranges]) if s.eos_id is not None else None

            def pick(free):
                p = self.scheduler.pick(free)
                return None if p is None else self._prepare(p)

            self.scheduler.start_clock()
            ticks = self.executor.run(pick, self._stage, self._finish, self._feedback)
            tl = self.executor.timeline.resolve()
        self._summarise(tl, ticks, requests)
        if not is_last:
            return None
        tokens = self.out_tokens.tolist()  # the one device -> host copy of the tokens
        return [tokens[r.index][: self.scheduler.generated[r.index]] for r in requests]

    def _prepare(self, p: Pass) -> executor.Pass:
        """A scheduled pass, ready for the executor. Decode passes replay the decode graphs; with prefill graphs, a
        prefill pass of fixed batches is mixed (the scheduler's `mixed`) and replays the group's prefill graph padded
        to its rows, and one of continuous batching replays the smallest top-row graph that holds it, padded below (an
        eager pass of a few rows costs ~30 ms of launches for model=small on an H200); without, it runs eagerly on
        its rows."""
        graph = p.decode_only or self.scheduler.mixed or bool(self.row_classes)
        if p.token_major:  # padded on the host, so every stage, transfer and graph sees the class's [1, c] shapes
            graph = bool(self.mixed_classes)
            if graph:
                pad_mixed_pass(p, choose_shape_class(self.mixed_classes, p.T))
        elif not p.decode_only and self.scheduler.mixed:
            p.pad_rows(self.ranges[p.group][1] - self.ranges[p.group][0])
        elif not p.decode_only and self.row_classes:  # top-aligned: the smallest class of top rows that holds the pass
            p.pad_front(choose_shape_class(self.row_classes, p.rows))
        rows = p.rows
        cols, keys = [0] * rows, [0] * rows
        for r, c, req, k in p.emit:
            cols[r], keys[r] = c, self.key_ids[req] * TOKEN_KEY + k
        p.graph = graph
        if not p.decode_only and not p.token_major and "dense" in self.prefill_paths:
            topk, cache_rows = self.model_cfg.index_topk, self.serve.max_context + 1
            p.hint = plan_prefill(p.positions, topk, cache_rows, **self.prefill_rule)
            if graph and p.hint is not None and p.hint.path == "masked":
                p.hint = None  # no masked graphs (dense_prefill.graph_classes): the sparse graph replays
            p.path = dense_prefill.graph_label(p.hint, topk, cache_rows)
        first, last = self.first in self.stages, self.last in self.stages
        p.dev = self.upload(pass_vectors(p, cols, keys, first, last, self.out_width, self.keyed))
        # what travels: with graphs.transfers a decode pass's rows padded to their class (the tick's shapes recur)
        sent = choose_shape_class(self.transfer_classes, rows) if self.transfer_classes and p.decode_only else rows
        batch = 1 if p.token_major else sent  # a mixed pass's activations are [1, T, dim]; its message [rows, 2]
        extra = (((batch, p.T, self.model_cfg.index_topk), torch.int32),) if self.cross_stage else ()
        hidden = (batch, p.T, self.model_cfg.dim)
        return executor.Pass(p.group, hidden, self.dtype, p, (sent, 2), p.decode_only, extra, mixed=p.token_major)

    def _transfer_graphs(self) -> Optional[TransferGraphs]:
        """The rank's TransferGraphs (graphs.transfers, kept across runs), or None."""
        if self.transfer_classes and self.link is not None and self.transfers is None:
            self.transfers = TransferGraphs(self.link, self.device, capturer=self.transfer_capturer)
        return self.transfers

    def _summarise(self, tl: Dict[str, float], ticks: int, requests: List[Request]) -> None:
        self.timings["prefill_s"] = tl["wall_s"] - tl["decode_wall_s"]
        self.timings["decode_s"] = tl["decode_wall_s"]
        done = {r.index: self.scheduler.generated[r.index] for r in requests}
        ttft, tpot = self.executor.timeline.latencies(self.first_mark, self.last_mark, done)
        self.stats = run_stats(tl, ticks, (self.scheduler.from_arrival(ttft), tpot), int(self.timings["tokens"]))
