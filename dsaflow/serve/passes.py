"""What the serving scheduler hands the engine: a request, a cache row's progress, and a pass (one group's forward
over its rows) with the device tensors the engine uploads for it. Their own module, so that the scheduler
(dsaflow/serve/scheduler.py) and the mixed-pass builder (dsaflow/serve/mixed.py) both build passes without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclass
class Request:
    index: int  # position in the input (outputs come back in this order)
    prompt: List[int]
    max_new: int  # its own limit (the JSONL's max_new_tokens, else serve.max_new_tokens)


@dataclass
class Row:
    request: Request
    offset: int = 0  # prompt tokens already sent through the stages
    generated: int = 0  # tokens emitted so far


@dataclass
class PassInputs:
    """The device int64 tensors of one pass that this rank's stages read, views of one uploaded buffer
    (`PipelineEngine._upload`); None where this rank reads none.

    Every rank: positions [rows, T] ([1, T] token-major); with a refill's row moves, move_from / move_to [moves].
    Stage 0's rank: tokens [rows, T] unless the pass only decodes (its rows then read their previous tokens);
    decode [rows] (1 = column 0 takes the row's previous token) when a row-major pass mixes decoding and prefilling
    rows; swap_cols / swap_rows [decoding] (a token-major pass: the columns that take the decoding rows' previous
    tokens, and those rows); fed_from [emitted]: the pass rows that sample (their tokens are the group's next input),
    left out when every row samples in order. Token-major: token_rows [1, T], each token's group row.
    The last stage's rank: cols [rows] (the sampled column of each row) when T > 1 or token-major; keys [rows] when
    sampling is keyed (temperature > 0); emit_slots [emitted]: request x out_width + token index, a flat index into
    the output tokens; emit_rows [emitted]: the pass rows that sample, left out when every row samples in order."""

    positions: torch.Tensor
    tokens: Optional[torch.Tensor] = None
    token_rows: Optional[torch.Tensor] = None
    move_from: Optional[torch.Tensor] = None
    move_to: Optional[torch.Tensor] = None
    decode: Optional[torch.Tensor] = None
    swap_cols: Optional[torch.Tensor] = None
    swap_rows: Optional[torch.Tensor] = None
    fed_from: Optional[torch.Tensor] = None
    cols: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    emit_rows: Optional[torch.Tensor] = None
    emit_slots: Optional[torch.Tensor] = None


@dataclass
class Pass:
    """One group's forward over its rows [row0, row0 + rows), through every stage.

    The scheduler fills the host lists: tokens, positions [rows][T]; decode[r]: row r's column 0 is its previous
    sampled token; emit: (row, column, request index, token index) of every row that samples a token in this pass;
    advance: row -> its prompt offset after this pass (prefilling rows). Rows are local to the pass (row r is cache
    row row0 + r of the group). A mixed pass (dsaflow.serve.mixed) is token-major: tokens / positions [1][T],
    token_rows[t] = the group row of token t; its message is still [rows, 2], row r sampling from its emit column.

    The engine fills the rest (`PipelineEngine._prepare`): graph, whether the pass replays graphs; hint, a short
    prefill pass's attention path (dsaflow.model.dense_prefill; None = sparse); path, the label of the prefill graph
    it replays; inputs, its device tensors (`PassInputs`); and what the pipeline schedule moves
    (dsaflow.pipeline.ticks): hidden [batch, T, dim] / hidden_dtype, the activation between stages; extra, the
    (shape, dtype) of the cross-stage indices that travel with it; feedback, the shape of the [rows, 2] int64
    message (tokens, EOS flags) the last stage sends back. The schedule sets `start`; the last stage's rank sets
    `finished_at` (the timeline mark that ends the pass's last span)."""

    group: int
    row0: int
    rows: int
    T: int
    tokens: List[List[int]]
    positions: List[List[int]]
    decode: List[bool]
    emit: List[Tuple[int, int, int, int]] = field(default_factory=list)
    advance: Dict[int, int] = field(default_factory=dict)
    decode_only: bool = False  # no row prefills: a decode step of the group
    moves: List[Tuple[int, int]] = field(default_factory=list)  # (from, to) group rows, moved before this pass
    move_len: int = 0  # cached positions [0, move_len) hold every moved row's keys: only they need copying
    token_rows: List[int] = field(default_factory=list)
    token_major: bool = False  # a mixed pass: token_rows addresses each token's row
    speculative: bool = False  # a verify pass (dsaflow.serve.speculative_engine): last token + drafts per row
    graph: bool = field(default=False, compare=False)
    hint: Any = field(default=None, compare=False)
    path: str = field(default="sparse", compare=False)
    inputs: Optional[PassInputs] = field(default=None, compare=False)
    hidden: Tuple[int, ...] = field(default=(), compare=False)
    hidden_dtype: Optional[torch.dtype] = field(default=None, compare=False)
    extra: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...] = field(default=(), compare=False)
    feedback: Optional[Tuple[int, ...]] = field(default=None, compare=False)
    start: int = field(default=-1, compare=False)
    finished_at: Any = field(default=None, compare=False)

    def pad_rows(self, rows: int) -> None:
        """Append idle rows (position -1) up to `rows` (for a graph with a static row count)."""
        extra = rows - self.rows
        self.tokens += [[0] * self.T for _ in range(extra)]
        self.positions += [[-1] * self.T for _ in range(extra)]
        self.decode += [False] * extra
        self.rows = rows

    def pad_front(self, rows: int) -> None:
        """Prepend idle rows up to `rows`, so that the pass ends where it ended and starts `rows` rows below (a
        top-aligned graph of `rows` rows)."""
        extra = rows - self.rows
        if extra > self.row0:
            raise ValueError(f"pad_front({rows}): the pass starts at row {self.row0}, {extra} rows would not fit below")
        self.tokens = [[0] * self.T for _ in range(extra)] + self.tokens
        self.positions = [[-1] * self.T for _ in range(extra)] + self.positions
        self.decode = [False] * extra + self.decode
        self.emit = [(r + extra, c, req, k) for r, c, req, k in self.emit]
        self.advance = {r + extra: offset for r, offset in self.advance.items()}
        self.row0, self.rows = self.row0 - extra, rows
