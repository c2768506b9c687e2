"""Speculative decoding in the pipeline engine (serve.speculative_tokens=K): the MTP layer drafts K tokens for each
decoding row, and the row's next pass verifies them. The engine (dsaflow/serve/engine.py) calls `EngineSpeculation`
at four points and the scheduler builds verify passes with `verify_pass`; the rules are those of the plain-torch
reference (dsaflow/serve/speculative.py), which gives the same tokens.

A pass of a group, with speculation on:
- prefill (a prompt chunk per prefilling row, as without speculation): the last stage samples each row whose chunk
  ends its prompt, then runs the first MTP layer over the chunk (each position's normed hidden state and the token
  after it: the prompt's next token, or the sampled one at the prompt's end) and chains it K times from the prompt's
  last position: K drafts;
- verify (every decoding row, [rows, K + 1], row-major like a prefill chunk): row r feeds its last token and its K
  drafts at positions p .. p + K (fewer where the row has fewer tokens left to emit; the rest is padding at -1).
  The last stage accepts greedily (dsaflow.serve.speculation.accept_greedy): n drafts, plus the target's token
  after them, n + 1 tokens; it rolls the rejected positions out of its caches (MTP rows included), extends the MTP
  layer over the kept positions and drafts K more.

The last stage sends a [rows, 2K + 4] int64 message (`message_width`) to every rank: the row's next input token,
the drafts it accepted, the tokens it emits, its K new drafts, and those tokens. Every rank reads it on the host
when the pass leaves the pipeline (one small host sync per pass: the scheduler must know how far each row
advanced before it builds the group's next pass, and every rank builds the same passes from it), rolls the rejected
positions out of its own stages' caches, and advances the scheduler by the row's tokens, cut at its
max_new_tokens (the pass never feeds more positions than the row may emit) and after serve.eos_id. Stage 0's rank
keeps the drafts for the group's next pass.

Supported: greedy (temperature 0), eager passes (graphs off), fixed and continuous batching, any pipeline split and
groups in flight, one replica. `check_speculation` refuses the rest before launch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from dsaflow.errors import ServeError
from dsaflow.model.cache_rollback import roll_back_positions

from .passes import Pass, Row
from .speculation import accept_greedy
from .speculative import SpeculationStats, mtp_pass


def check_speculation(model_cfg, serve_cfg, plan) -> None:
    """serve.speculative_tokens > 0 needs a model with an MTP layer and a configuration the engine speculates in;
    raises ServeError naming the field, its value and the fix."""
    k, dp = serve_cfg.speculative_tokens, plan.pipeline.dp
    if not k:
        return
    if model_cfg.mtp_layers < 1:
        raise ServeError(
            f"serve.speculative_tokens={k} needs a model with multi-token-prediction layers, but model.mtp_layers="
            f"{model_cfg.mtp_layers}. Fix: serve.speculative_tokens=0, or a model with model.mtp_layers>=1 (trained "
            f"with train.mtp_loss_weight > 0, or a Hugging Face checkpoint that has MTP layers)."
        )
    unsupported = [
        (serve_cfg.temperature > 0, f"serve.temperature={serve_cfg.temperature}", "serve.temperature=0 (greedy)"),
        (bool(plan.graph_blocks), f"graphs blocks {[b.name for b in plan.graph_blocks]}", "graphs=off"),
        (
            serve_cfg.max_pass_tokens is not None,
            f"serve.max_pass_tokens={serve_cfg.max_pass_tokens}",
            "serve.max_pass_tokens=null",
        ),
        (dp > 1, f"parallel.dp={dp} (serving replicas)", "parallel.dp=1"),
    ]
    for bad, what, fix in unsupported:
        if bad:
            raise ServeError(
                f"serve.speculative_tokens={k} does not run with {what} yet. Fix: {fix}, or serve.speculative_tokens=0."
            )


def verify_pass(group: int, rows: List[Optional[Row]], decoding: Sequence[int], k: int) -> Pass:
    """The verify pass of a group's decoding rows: rows [0, last decoding row], [rows, k + 1]; row i feeds its last
    token and k drafts (swapped in on stage 0) at positions p .. p + w - 1, p = len(prompt) + generated - 1 and
    w = min(k + 1, tokens the row has left), so a pass never writes a position the row cannot reach."""
    n, T = decoding[-1] + 1, k + 1
    p = Pass(group, 0, n, T, [[0] * T for _ in range(n)], [[-1] * T for _ in range(n)], [False] * n)
    p.speculative = True
    for i in decoding:
        row, req = rows[i], rows[i].request
        start, width = len(req.prompt) + row.generated - 1, min(T, req.max_new - row.generated)
        p.decode[i] = True
        p.positions[i][:width] = range(start, start + width)
        p.emit.append((i, 0, req.index, row.generated))
    return p


def message_width(k: int) -> int:
    """Columns of the last stage's message: next token, accepted drafts, emitted count, k drafts, k + 1 tokens."""
    return 2 * k + 4


class EngineSpeculation:
    """One rank's speculation state for `PipelineEngine`: k drafts per row, the drafts per group (`fed` on stage
    0's rank, what the group's next verify pass feeds; `held` on the last stage's rank, what it verifies), and the
    acceptance counts (`stats`, on every rank alike)."""

    def __init__(self, k: int, ranges, device: torch.device, eos_id: Optional[int], max_context: int):
        self.k, self.ranges, self.device, self.eos_id, self.max_context = k, list(ranges), device, eos_id, max_context
        self.width = message_width(k)
        self.start_run()

    def start_run(self) -> None:
        self.fed = [torch.zeros(b - a, self.k, dtype=torch.long, device=self.device) for a, b in self.ranges]
        self.held = [torch.zeros_like(f) for f in self.fed]
        self.stats = SpeculationStats(self.k)

    # --- stage 0 ---------------------------------------------------------------------------------------------------
    def first_input(self, p: Pass, v, x: torch.Tensor) -> torch.Tensor:
        """Stage 0's tokens [rows, T] of pass p (the rows' last tokens already in column 0): the group's drafts move
        with its rows, and a verify pass feeds them in columns 1 .. k."""
        fed = self.fed[p.group]
        if p.moves:
            fed.index_copy_(0, v.move_to, fed.index_select(0, v.move_from))
        if p.speculative:
            x[:, 1:] = fed[p.row0 : p.row0 + p.rows]
        return x

    # --- the last stage --------------------------------------------------------------------------------------------
    def after_sample(self, stage, cache, p: Pass, logits: torch.Tensor, sampled: torch.Tensor, rows) -> torch.Tensor:
        """Last stage, after pass p's forward: stage (its StageModule), cache (the pass's rows of its cache), logits
        [rows, T, V], sampled [rows, 2] (the plain sampling's message), rows (the scheduler's rows of the group) ->
        the [rows, width] message. Verifies a verify pass's drafts, rolls back its rejected positions, and drafts k
        tokens for every row that emitted."""
        held = self.held[p.group]
        v = p.inputs
        if p.moves:
            held.index_copy_(0, v.move_to, held.index_select(0, v.move_from))
        mine = held[p.row0 : p.row0 + p.rows]
        positions = v.positions
        if p.speculative:
            accepted, best = accept_greedy(logits, mine)
            width = (positions >= 0).sum(dim=1)
            # a row near its max_new_tokens feeds fewer positions: drafts past them are not verified, not accepted
            accepted = torch.minimum(accepted, width - 1).clamp_min(0)
            emitted = accepted + 1
            start = positions[:, 0]
            roll_back_positions(cache, start + emitted, start + width, self.k + 1)
            cols = torch.arange(self.k + 1, device=logits.device)
            positions = torch.where(cols < emitted.unsqueeze(1), positions, -1)
            last, after = emitted - 1, best
        else:  # a prefill pass: the token after each position is the prompt's next, or the sampled one at its end
            after, last = self._prompt_next(p, rows, sampled[:, 0])
            accepted = torch.zeros(p.rows, dtype=torch.long, device=logits.device)
            emitted = torch.ones_like(accepted)
            best = torch.zeros(p.rows, self.k + 1, dtype=torch.long, device=logits.device)
            best[:, 0] = sampled[:, 0]
        drafts = self._draft(stage, cache, after, positions, last)
        mine.copy_(drafts)
        nxt = best.gather(1, (emitted - 1).unsqueeze(1))
        return torch.cat([nxt, accepted.unsqueeze(1), emitted.unsqueeze(1), drafts, best], dim=1)

    def _prompt_next(self, p: Pass, rows, sampled: torch.Tensor):
        """A prefill pass -> (the token after each position [rows, T]: the prompt's next token, the sampled one
        where the prompt ends; each row's draft column [rows]: its emit column, 0 where it does not emit)."""
        after = [[0] * p.T for _ in range(p.rows)]
        for r, offsets in enumerate(p.positions):
            row = rows[p.row0 + r]
            if row is None:
                continue
            prompt = row.request.prompt
            for c, q in enumerate(offsets):
                if 0 <= q < len(prompt) - 1:
                    after[r][c] = prompt[q + 1]
        cols = [0] * p.rows
        for r, c, _, _ in p.emit:
            cols[r] = c
        after_t = torch.tensor(after, dtype=torch.long).to(self.device)
        last = torch.tensor(cols, dtype=torch.long).to(self.device)
        emits = torch.tensor([r for r, *_ in p.emit], dtype=torch.long).to(self.device)
        after_t[emits, last[emits]] = sampled[emits]
        return after_t, last

    def _draft(self, stage, cache, after: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the pass's kept positions (stage.head_input [rows, T, dim], after [rows, T],
        positions [rows, T]), then chained k - 1 times from column last[r] -> drafts [rows, k] (greedy). Chain
        positions past the cache are padding (the row cannot reach them)."""
        rows = torch.arange(after.shape[0], device=after.device)
        g = mtp_pass(stage, cache, stage.head_input, after, positions)[rows, last].unsqueeze(1)
        pos = positions[rows, last].unsqueeze(1)
        drafts = [stage.head(g).argmax(dim=-1)]
        for _ in range(self.k - 1):
            pos = torch.where((pos >= 0) & (pos + 1 < self.max_context), pos + 1, -1)
            g = mtp_pass(stage, cache, g, drafts[-1], pos)
            drafts.append(stage.head(g).argmax(dim=-1))
        return torch.cat(drafts, dim=1)

    # --- every rank, when the pass left the pipeline -----------------------------------------------------------------
    def finish(self, engine, p: Pass, message: torch.Tensor) -> List[int]:
        """Pass p is through (message [rows, width] on every rank): roll back this rank's other stages, keep the
        drafts (stage 0), count acceptance, write the tokens (the last stage), advance the scheduler -> the requests
        that finished."""
        scheduler = engine.scheduler
        if not p.emit:
            return scheduler.finish(p)
        host = message[: p.rows].tolist()  # the one host read of the pass: how far each row advanced
        k = self.k
        tokens, eos = [], [False] * p.rows
        for r, c, req, first in p.emit:
            run = host[r][3 + k : 3 + k + host[r][2]]
            if self.eos_id is not None and self.eos_id in run:
                run, eos[r] = run[: run.index(self.eos_id) + 1], True
            tokens += [(r, c + j, req, first + j, t) for j, t in enumerate(run)]
        if p.speculative:
            self.stats.add(torch.tensor([host[r][1] for r, *_ in p.emit]), torch.ones(len(p.emit), dtype=torch.bool))
            self._roll_back(engine, p, host)
        emit_rows = torch.tensor([r for r, *_ in p.emit], dtype=torch.long, device=self.device)
        if engine.first_here:
            fed = self.fed[p.group][p.row0 : p.row0 + p.rows]
            fed.index_copy_(0, emit_rows, message[: p.rows, 3 : 3 + k].index_select(0, emit_rows))
        p.emit = [e[:4] for e in tokens]
        done = scheduler.finish(p)
        kept = {(e[2], e[3]) for e in p.emit}
        if engine.out_tokens is not None:
            slots = [req * engine.out_width + i for _, _, req, i, _ in tokens if (req, i) in kept]
            values = [t for _, _, req, i, t in tokens if (req, i) in kept]
            engine.out_tokens.view(-1)[torch.tensor(slots, dtype=torch.long).to(self.device)] = torch.tensor(
                values, dtype=torch.long
            ).to(self.device)
        return done + scheduler.end(p, eos)

    def _roll_back(self, engine, p: Pass, host) -> None:
        """Forget the rejected positions of a verify pass in this rank's caches but the last stage's (which rolled
        back before drafting)."""
        start = [row[0] for row in p.positions]
        emitted = [0] * p.rows
        for r, *_ in p.emit:
            emitted[r] = host[r][2]
        first = torch.tensor([s + e for s, e in zip(start, emitted)], dtype=torch.long).to(self.device)
        stop = torch.tensor([s + sum(q >= 0 for q in row) for s, row in zip(start, p.positions)]).to(self.device)
        for s in engine.stages:
            if s != engine.last:
                cache = engine.group_caches[s][p.group]
                if p.row0 > 0:
                    cache = cache.rows(p.row0, p.row0 + p.rows)
                roll_back_positions(cache, first, stop, self.k + 1)

    def summary(self) -> dict:
        return {"speculative_tokens": self.k, **self.stats.summary()}


def speculation_line(summary: dict) -> str:
    """`EngineSpeculation.summary()` -> the generate summary's words for it."""
    per = ", ".join(f"{a:.2f}" for a in summary["per_position"])
    return (
        f"speculation: {summary['speculative_tokens']} MTP drafts per verify pass, {summary['acceptance_rate']:.2f} "
        f"of them accepted (by position: {per}), {summary['mean_accept_length']:.2f} tokens per verify pass"
    )
