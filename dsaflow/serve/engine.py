"""Pipeline inference engine: chunked prefill, then decode steps, across the stages of a plan.

Every rank runs the same host loop over the same batches (all ranks read the same prompts), and does only the work of
the stages it owns, in pipeline order:

    stage s input = token ids (s = 0) | the previous stage's output (same rank) | a recv from the previous rank
    stage s output -> the next stage (same rank) | a send to the next rank
    last stage: pick each row's last-prompt-token logits (prefill) or the step's logits (decode), sample the next token
    on the device, and send the token ids back to stage 0's rank (p2p) for the next step.

Requests are padded into a batch of n <= `batch_cap` rows; a stage with a decode / prefill graph block runs through
the GraphManager, which pads n up to the block's shape class (padding rows have position -1 and write only the cache's
trash row). Transfers stay outside graphs. No host sync inside a step: positions are built on the device from the
prompt lengths, sampling is branchless, tokens accumulate on the device and reach the host once per batch. The one
exception is optional: with `serve.eos_id` set, every step ends with one small sync (plus a MAX all-reduce across
ranks) to stop when every row has produced EOS.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import torch
from torch import nn

from dsaflow.errors import ServeError
from dsaflow.plan.plan import Plan
from dsaflow.run.stages import stage_cache

from .graphs import GraphManager, StaticInput
from .report import CaptureReport
from .sampling import make_generator, sample_next

SERVED_KINDS = ("decode", "prefill")




def check_prompts(prompts: List[List[int]], serve, vocab_size: int) -> None:
    """Token-id prompts must be non-empty, fit serve.max_context with serve.max_new_tokens, and stay in the vocab.
    The parent checks them before launch (serve.check_serve) and the engine again per request."""
    for i, p in enumerate(prompts):
        if not p:
            raise ServeError(f"prompt {i} is empty. Fix: every prompt needs at least one token.")
        if len(p) + serve.max_new_tokens > serve.max_context:
            raise ServeError(
                f"prompt {i} is {len(p)} tokens; with serve.max_new_tokens={serve.max_new_tokens} it exceeds "
                f"serve.max_context={serve.max_context}. Fix: serve.max_context={len(p) + serve.max_new_tokens} or "
                f"more, or shorten the prompt / lower serve.max_new_tokens."
            )
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ServeError(f"prompt {i} has token id {bad[0]} outside model.vocab_size={vocab_size}. Fix: "
                             f"token ids in [0, {vocab_size}).")


def check_graph_blocks(plan: Plan, serve_cfg) -> None:
    """The plan's graph blocks must fit the serve config: one decode and one prefill block at most; decode classes <=
    serve.max_batch (cache rows); the largest prefill class == serve.prefill_chunk (the index cache holds one chunk).
    The planner already refused every kind serving does not capture (dsaflow.plan.graph_blocks)."""
    for b in plan.graph_blocks:
        if b.kind == "decode" and max(b.shape_classes) > serve_cfg.max_batch:
            raise ServeError(
                f"graphs.blocks[{b.name}].shape_classes={list(b.shape_classes)} go beyond serve.max_batch="
                f"{serve_cfg.max_batch} (the caches hold that many rows). Fix: drop the larger classes or set "
                f"serve.max_batch={max(b.shape_classes)}."
            )
        if b.kind == "prefill" and max(b.shape_classes) != serve_cfg.prefill_chunk:
            raise ServeError(
                f"graphs.blocks[{b.name}].shape_classes={list(b.shape_classes)}: the largest prefill class must equal "
                f"serve.prefill_chunk={serve_cfg.prefill_chunk} (every chunk must fit a class, and the index cache "
                f"holds one chunk). Fix: serve.prefill_chunk={max(b.shape_classes)}, or change the classes."
            )
    kinds = [b.kind for b in plan.graph_blocks]
    for k in SERVED_KINDS:
        if kinds.count(k) > 1:
            raise ServeError(f"graphs.blocks has {kinds.count(k)} blocks of kind={k}. Fix: keep one per kind.")


class PipelineEngine:
    """Serving state of one rank: its stage modules, their caches, its graph manager and the p2p link.

    stages: {stage index: StageModule} for the stages this rank owns (already on `device`, in `dtype`, eval mode);
    given every stage of the plan, the engine runs the whole pipeline in this process (tests, one-GPU benchmarks).
    link: a `StageLink` when stages live on other ranks, else None (all stages local).
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
    ):
        self.model_cfg, self.plan, self.stages, self.serve = model_cfg, plan, stages, serve_cfg
        self.device, self.dtype, self.rank, self.link = torch.device(device), dtype, rank, link
        # stage -> rank that runs it; when this process was handed every stage, it runs them all locally
        local_all = len(stages) == plan.num_stages
        self.owner = {s.index: (rank if local_all else s.rank) for s in plan.stages}
        self.first, self.last = 0, plan.num_stages - 1
        self.blocks = {s: self._served_blocks(s) for s in stages}
        decode = [max(b.shape_classes) for blocks in self.blocks.values() for b in blocks if b.kind == "decode"]
        self.batch_cap = min([serve_cfg.max_batch] + decode)
        self.caches = {
            s: stage_cache(
                model_cfg, plan, s, serve_cfg.max_batch, serve_cfg.max_context, serve_cfg.prefill_chunk,
                self.device, dtype,
            )
            for s in stages
        }
        self.graphs = GraphManager(
            self.device, cache=graphs_cfg.cache, on_failure=graphs_cfg.on_failure, force_eager=force_eager,
            rank=rank, capturer=capturer,
        )
        self.prefill_rows: Optional[int] = None  # static batch of prefill graphs (None: prefill runs n rows eagerly)
        for s, blocks in self.blocks.items():
            for b in blocks:
                self._register(s, b)
        self.record_logits = False
        # strict_sync: run every decode step under torch.cuda.set_sync_debug_mode("error") (proof of no host sync;
        # needs graphs.cache=true and no eos_id, since a fresh capture and the EOS check do sync by design)
        self.strict_sync = False
        self.logits_log: List[torch.Tensor] = []  # last stage, when record_logits: [n, V] per generated token
        self.timings: Dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}

    # --- setup -------------------------------------------------------------------------------------------------
    def _served_blocks(self, stage: int):
        check_graph_blocks(self.plan, self.serve)
        return self.plan.blocks_of_stage(stage)

    def _stage_input(self, stage: int, rows: int, tokens: int) -> StaticInput:
        if stage == self.first:
            return StaticInput((rows, tokens), torch.long, 0)
        return StaticInput((rows, tokens, self.model_cfg.dim), self.dtype, 0)

    def _received(self, stage: int, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Cross-stage indices: a stage that opens on S reads the indices the previous stage sent, which
        `_run_stage` copies into this stage's static index buffer outside any graph -> that buffer's [R, T] view
        (static memory, so a captured graph reads what each call copied in); None for other stages."""
        if not self.plan.receives_indices(stage):
            return None
        R, T = positions.shape
        return self.caches[stage].index[:R, :T]

    def _register(self, stage: int, block) -> None:
        module, cache = self.stages[stage], self.caches[stage]
        top = max(block.shape_classes)
        if block.kind == "decode":  # class = batch rows, one token each
            inputs = {"x": self._stage_input(stage, top, 1), "positions": StaticInput((top, 1), torch.long, -1)}
            fn = lambda v: module(v["x"], v["positions"], cache,  # noqa: E731
                                  indices_in=self._received(stage, v["positions"]))
            self.graphs.register(block.name, "decode", stage, block.shape_classes, 0, fn, inputs)
        else:  # prefill: class = tokens per chunk, batch fixed at batch_cap rows
            rows = self.prefill_rows = self.batch_cap
            inputs = {"x": self._stage_input(stage, rows, top), "positions": StaticInput((rows, top), torch.long, -1)}
            fn = lambda v: module(v["x"].contiguous(), v["positions"].contiguous(), cache,  # noqa: E731
                                  indices_in=self._received(stage, v["positions"]))
            self.graphs.register(block.name, "prefill", stage, block.shape_classes, 1, fn, inputs)

    def _on_device(self):
        """Device guard: every kernel (eager Triton launches included) runs on this rank's device, whatever the
        process's current device is."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _sync_guard(self):
        if not (self.strict_sync and self.device.type == "cuda"):
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

    @torch.no_grad()
    def capture(self) -> CaptureReport:
        """Capture every requested block of this rank (at setup), check none is missing, reset the caches."""
        with self._on_device():
            report = self.graphs.capture_all()
        for c in self.caches.values():
            c.reset()
        return report

    # --- one forward through this rank's stages ------------------------------------------------------------------
    def _block_name(self, stage: int, kind: str) -> Optional[str]:
        for b in self.blocks.get(stage, ()):
            if b.kind == kind:
                return b.name
        return None

    def _run_stage(self, stage: int, kind: str, x: torch.Tensor, positions: torch.Tensor,
                   indices: Optional[torch.Tensor] = None):
        """-> (output, the indices the next stage reads [R, T, topk] (the stage's static index buffer; with
        cross-stage indices)). indices: what the previous stage sent, copied into this stage's buffer first."""
        cache = self.caches[stage]
        R, T = positions.shape
        if indices is not None:
            cache.index[:R, :T].copy_(indices)
        name = self._block_name(stage, kind)
        if name is None:
            h = self.stages[stage](x, positions, cache, indices_in=self._received(stage, positions))
        else:
            n = x.shape[0] if kind == "decode" else x.shape[1]
            h = self.graphs.run(name, stage, n, {"x": x, "positions": positions})
        return h, cache.index[:R, :T]

    def _forward(self, kind: str, tokens: Optional[torch.Tensor], positions: torch.Tensor) -> Optional[torch.Tensor]:
        """tokens [R, T] (used on stage 0's rank), positions [R, T] -> last-stage logits [R, T, V] on its rank."""
        R, T = positions.shape
        h, idx = None, None
        for s in range(self.plan.num_stages):
            if self.owner[s] != self.rank:
                continue
            receives = self.plan.receives_indices(s)  # cross-stage indices travel with the hidden state
            if s == self.first:
                inp = tokens
            elif self.owner[s - 1] == self.rank:
                inp = h
            else:
                inp = self.link.recv((R, T, self.model_cfg.dim), self.dtype, self.owner[s - 1])
                if receives:
                    idx = self.link.recv((R, T, self.model_cfg.index_topk), torch.int32, self.owner[s - 1])
            h, idx = self._run_stage(s, kind, inp, positions, idx if receives else None)
            if s != self.last and self.owner[s + 1] != self.rank:
                self.link.send(h, self.owner[s + 1])
                if self.plan.sends_indices(s):
                    self.link.send(idx, self.owner[s + 1])
        return h if self.owner[self.last] == self.rank else None

    def _tokens_to_first(self, tok: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
        """Token ids [n] from the last stage's rank to stage 0's rank (p2p), or as is when they share a rank."""
        src, dst = self.owner[self.last], self.owner[self.first]
        if src == dst:
            return tok
        if self.rank == src:
            self.link.send(tok, dst)
            return None
        if self.rank == dst:
            return self.link.recv((n,), torch.long, src).clone()
        return None

    # --- generation --------------------------------------------------------------------------------------------
    def check_request(self, prompts: List[List[int]]) -> None:
        check_prompts(prompts, self.serve, self.model_cfg.vocab_size)

    @torch.no_grad()
    def generate(self, prompts: List[List[int]]) -> Optional[List[List[int]]]:
        """Token-id prompts -> generated token ids per prompt (on the last stage's rank; None on the others).

        Batches of at most `batch_cap` prompts, in order. Sampling restarts from serve.seed on every call."""
        self.check_request(prompts)
        self.generator = make_generator(self.device, self.serve.seed)
        self.logits_log = []
        out: List[List[int]] = []
        for i in range(0, len(prompts), self.batch_cap):
            with self._on_device():
                got = self._generate_batch(prompts[i : i + self.batch_cap])
            if got is not None:
                out.extend(got)
        return out if self.owner[self.last] == self.rank else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generate_batch(self, prompts: List[List[int]]) -> Optional[List[List[int]]]:
        n, lens = len(prompts), [len(p) for p in prompts]
        s, dev = self.serve, self.device
        is_last = self.owner[self.last] == self.rank
        for c in self.caches.values():
            c.reset()
        self._sync()
        t0 = time.perf_counter()
        # chunked prefill: chunk j holds prompt tokens [j*C, (j+1)*C) of every row; shorter rows pad with position -1
        rows = self.prefill_rows or n
        C, L = s.prefill_chunk, max(lens)
        V = self.model_cfg.vocab_size
        next_logits = torch.zeros(n, V, device=dev) if is_last else None
        for c0 in range(0, L, C):
            t = min(C, L - c0)
            tok = torch.zeros(rows, t, dtype=torch.long)
            pos = torch.full((rows, t), -1, dtype=torch.long)
            for i, p in enumerate(prompts):
                seg = p[c0 : c0 + t]
                tok[i, : len(seg)] = torch.tensor(seg, dtype=torch.long)
                pos[i, : len(seg)] = torch.arange(c0, c0 + len(seg))
            logits = self._forward("prefill", tok.to(dev), pos.to(dev))
            if is_last:  # rows whose last prompt token falls in this chunk (host-known: no sync)
                r = [i for i in range(n) if c0 <= lens[i] - 1 < c0 + t]
                if r:
                    ri = torch.tensor(r, device=dev)
                    ci = torch.tensor([lens[i] - 1 - c0 for i in r], device=dev)
                    next_logits[ri] = logits[ri, ci].float()
        tok = self._sample(next_logits) if is_last else None
        self._sync()
        t1 = time.perf_counter()
        # decode: step k feeds the token generated at k-1 at position len + k
        lens_dev = torch.tensor(lens, dtype=torch.long, device=dev)
        generated = torch.zeros(n, s.max_new_tokens, dtype=torch.long, device=dev) if is_last else None
        steps = 0
        for k in range(s.max_new_tokens):
            if is_last:
                generated[:, k] = tok
            if k == s.max_new_tokens - 1 or self._all_done(generated, k):
                break
            with self._sync_guard():  # one decode step: no host sync from here to the next token
                tok = self._tokens_to_first(tok, n)
                pos = (lens_dev + k).view(n, 1)
                logits = self._forward("decode", tok.view(n, 1) if tok is not None else None, pos)
                tok = self._sample(logits[:, -1]) if is_last else None
            steps += 1
        self._sync()
        t2 = time.perf_counter()
        self.timings["prefill_s"] += t1 - t0
        self.timings["decode_s"] += t2 - t1
        self.timings["decode_steps"] += steps
        self.timings["tokens"] += n * (steps + 1)
        if not is_last:
            return None
        return [self._trim(row) for row in generated.tolist()]  # the one device -> host copy of the batch

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        if self.record_logits:
            self.logits_log.append(logits.float().clone())
        return sample_next(logits, self.serve.temperature, self.serve.top_p, self.generator)

    def _all_done(self, generated: Optional[torch.Tensor], k: int) -> bool:
        """With serve.eos_id: one sync per step (+ a MAX all-reduce across ranks) -> every row has emitted EOS."""
        eos = getattr(self.serve, "eos_id", None)
        if eos is None:
            return False
        flag = torch.zeros(1, dtype=torch.long, device=self.device)
        if generated is not None:
            flag = (generated[:, : k + 1] == eos).any(dim=1).all().long().view(1)
        if self.link is not None:
            flag = self.link.all_ranks_max(flag)
        return bool(flag.item())

    def _trim(self, row: List[int]) -> List[int]:
        eos = getattr(self.serve, "eos_id", None)
        if eos is not None and eos in row:
            return row[: row.index(eos) + 1]
        return row
