"""Evaluate F/S patterns on one trained model: calibration/eval LM loss and retrieval accuracy, re-running only what
a pattern change touches.

All stages live in this one process (the search runs in the parent, on CPU or one GPU) and run in order. A pattern
that differs from the current base pattern first at layer c computes exactly what the base pattern computed before
layer c, so `PatternEvaluator` keeps, per batch, the hidden state entering every layer and the stage's index slot
(which F layer wrote which indices) under the base pattern, and evaluates a candidate from layer c onwards only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from dsaflow.data.batches import IGNORE
from dsaflow.model.cache import IndexSlot
from dsaflow.model.context import TrainContext
from dsaflow.model.roles import set_roles
from dsaflow.model.stage import StageModule

Roles = Tuple[str, ...]


@dataclass
class Score:
    loss: float  # mean cross-entropy over every target position of every batch
    acc: float  # retrieval exact-match per query (nan without answers)


class PatternEvaluator:
    """stages: every StageModule of the model (built all-F), in order; batches: [(inputs [B, T], targets [B, 3, T])]
    (dsaflow.data.BatchSource layout). `score(roles)` -> Score; `rebase(roles)` moves the prefix cache."""

    def __init__(
        self,
        stages: Sequence[StageModule],
        batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        num_queries: int = 0,
        cross_stage: bool = False,
    ):
        """cross_stage: S layers opening a stage read the previous stages' last F (pipeline.cross_stage_indices)."""
        self.stages, self.device, self.num_queries = list(stages), device, num_queries
        self.cross_stage = cross_stage
        self.batches = [(x.to(device), y.to(device)) for x, y in batches]
        self.layer_ids = [[int(k) for k in s.layers.keys()] for s in self.stages]
        self.num_layers = sum(len(ids) for ids in self.layer_ids)
        self.stage_first = [ids[0] for ids in self.layer_ids]
        self.base: Optional[Roles] = None
        self.prefix: List[Dict[int, tuple]] = []
        self.layer_calls = 0  # layer forwards run so far (what the prefix cache saves is visible in tests)

    def _apply(self, roles: Roles) -> None:
        last_f = None  # with cross-stage indices a stage may open on S and read the previous stages' last F
        for s, ids in zip(self.stages, self.layer_ids):
            set_roles(s, {i: roles[i] for i in ids}, last_f if self.cross_stage else None)
            last_f = max([i for i in ids if roles[i] == "F"], default=last_f)

    @torch.no_grad()
    def _run(self, x: torch.Tensor, start: int, state, capture: Optional[dict]) -> torch.Tensor:
        """Logits [B, T, V] of the model from layer `start` on; `state` = (hidden entering `start`, slot indices,
        slot writer) from the prefix cache (ignored when start == 0). capture: filled with that state per layer."""
        B, T = x.shape
        positions = torch.arange(T, device=x.device).expand(B, T)
        rope_mla, rope_index = self.stages[0].rope_tables(positions)
        h = self.stages[0].embed(x) if start == 0 else state[0]
        slot = IndexSlot()
        for stage, ids in zip(self.stages, self.layer_ids):
            if ids[-1] < start:
                continue
            if not self.cross_stage:  # indices do not cross a stage: each stage starts with an empty slot
                slot = IndexSlot()
            if 0 < start and ids[0] <= start and (start > ids[0] or self.cross_stage):  # resume where `start` lies:
                # the slot holds what the base prefix wrote (with crossing, also what earlier stages wrote)
                slot.indices, slot.writer = state[1], state[2]
            ctx = TrainContext(
                positions=positions, rope_mla=rope_mla, rope_index=rope_index, attn="sparse", index_slot=slot
            )
            for i in ids:
                if i < start:
                    continue
                if capture is not None:
                    capture[i] = (h, slot.indices, slot.writer)
                h = stage.layers[str(i)](h, ctx)
                self.layer_calls += 1
            if stage.head is not None:
                return stage.head(stage.norm(h)).float()
        raise ValueError("PatternEvaluator: the last stage has no LM head (stages out of order?).")

    def _score_logits(self, logits_and_targets) -> Score:
        loss_sum, count, correct, total = 0.0, 0, 0, 0
        for logits, y in logits_and_targets:
            lm, ans, qid = y[:, 0], y[:, 1], y[:, 2]
            loss_sum += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), lm.reshape(-1), ignore_index=IGNORE, reduction="sum"
                )
            )
            count += int((lm != IGNORE).sum())
            if self.num_queries:
                hit = logits.argmax(-1) == ans
                for q in range(self.num_queries):
                    at = qid == q
                    seen = at.any(-1)
                    ok = (hit | ~at).all(-1) & seen
                    correct += int(ok.sum())
                    total += int(seen.sum())
        return Score(loss_sum / max(count, 1), correct / total if total else float("nan"))

    def rebase(self, roles: Roles) -> Score:
        """Make `roles` the base pattern, cache its prefix state and return its score. Layers before the first one
        that differs from the old base keep their cached state; the rest run again."""
        roles = tuple(roles)
        start = 0
        if self.base is not None and self.prefix:
            diff = [i for i in range(self.num_layers) if roles[i] != self.base[i]]
            start = diff[0] if diff else self.num_layers - 1
        self._apply(roles)
        self.base = roles
        outs, prefix = [], []
        for (x, y), old in zip(self.batches, self.prefix or [None] * len(self.batches)):
            cap = {i: v for i, v in old.items() if i < start} if start else {}
            outs.append((self._run(x, start, old.get(start) if start else None, cap), y))
            prefix.append(cap)
        self.prefix = prefix
        return self._score_logits(outs)

    def score(self, roles: Roles) -> Score:
        """Score `roles`, recomputing only from the first layer where it differs from the base pattern."""
        roles = tuple(roles)
        if self.base is None:
            return self.rebase(roles)
        diff = [i for i in range(self.num_layers) if roles[i] != self.base[i]]
        if not diff:
            start = 0
        else:
            start = diff[0]
        self._apply(roles)
        try:
            outs = [(self._run(x, start, cap.get(start), None), y) for (x, y), cap in zip(self.batches, self.prefix)]
        finally:
            self._apply(self.base)
        return self._score_logits(outs)
