"""What the serving scheduler hands the engine: a request, a cache row's progress, and a pass (one group's forward
over its rows). Their own module, so that the scheduler (dsaflow/serve/scheduler.py) and the mixed-pass builder
(dsaflow/serve/mixed.py) both build passes without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple


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
class Pass:
    """One group's forward over its rows [row0, row0 + rows). The scheduler fills the host lists; the engine prepares
    the rest (`PipelineEngine._prepare`) and hands the pass to the executor as a `dsaflow.pipeline.executor.Pass`'s
    payload.

    tokens, positions [rows][T]; decode[r]: row r's column 0 is its previous sampled token; emit: (row, column,
    request index, token index) of every row that samples a token in this pass; advance: row -> its prompt offset
    after this pass (prefilling rows). Rows are local to the pass (row r is cache row row0 + r of the group).
    Set by the engine: graph, whether the pass replays a graph; dev, name -> device int64 view of what this rank reads of the pass
    (dsaflow.serve.upload); hint, a short prefill pass's attention path (dsaflow.model.dense_prefill; None =
    sparse); path, the label of the prefill graph block it replays (dense_prefill.graph_label)."""

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
    graph: bool = field(default=False, compare=False)
    dev: Dict[str, Any] = field(default_factory=dict, compare=False)
    hint: Any = field(default=None, compare=False)
    path: str = field(default="sparse", compare=False)
    # a mixed pass (dsaflow.serve.mixed): token-major, tokens / positions [1][T], token_rows[t] = the group row of
    # token t; the message is still [rows, 2], row r sampling from its emit column
    token_rows: List[int] = field(default_factory=list)

    @property
    def token_major(self) -> bool:
        return bool(self.token_rows)

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
