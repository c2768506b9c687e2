"""Mixed passes (serve.max_pass_tokens): one token-major pass carries every decoding row's next token and as many
prompt tokens of joining rows as fit the token budget.

A mixed pass of a group is a batch of one row, [1, N], each token addressed by its cache row (`Pass.token_rows`) and
position (`StageModule.forward_prefill(token_rows=...)`, `MLA._forward_token_major`): no row is padded to another's
length, so a pass costs its N tokens, not rows x longest chunk. Its tokens, in order:

1. one token for every decoding row (ascending rows): its previous sampled token, swapped in on stage 0, at position
   len(prompt) + generated - 1. Decode rows are never starved: they take their tokens first, and the budget is
   checked to exceed the rows of a group (dsaflow.serve.checks), so each pass also moves some prompt forward;
2. prompt chunks of the prefilling rows in request order (the input order: deterministic, and the earliest request
   finishes its prompt first, which keeps TTFT low), each up to serve.prefill_chunk tokens and what is left of the
   budget. A row whose chunk ends its prompt samples its first token from its chunk's last column.

A group whose rows all decode runs the decode pass of dsaflow.serve.scheduler instead, through the decode graphs.
Greedy tokens do not depend on how the budget cuts the prompts: every token attends over its own row's cache, in
either layout, and sampling is keyed by (request, token index).
"""

from __future__ import annotations

from typing import List, Optional

from .passes import Pass, Row


def mixed_pass(group: int, rows: List[Optional[Row]], budget: int, chunk: int) -> Pass:
    """The mixed pass of a group with some prefilling row: rows [0, last row it addresses], token-major (T = its
    token count). `rows`: the group's rows (None = free); budget: serve.max_pass_tokens; chunk: serve.prefill_chunk."""
    active = [i for i, r in enumerate(rows) if r is not None]
    decoding = [i for i in active if rows[i].offset >= len(rows[i].request.prompt)]
    prefilling = sorted((i for i in active if i not in set(decoding)), key=lambda i: rows[i].request.index)
    tokens: List[int] = []
    positions: List[int] = []
    token_rows: List[int] = []
    decode = [False] * len(rows)
    emit, advance = [], {}
    for i in decoding:
        row = rows[i]
        decode[i] = True
        emit.append((i, len(tokens), row.request.index, row.generated))
        tokens.append(0)  # swapped for the row's previous token on stage 0
        positions.append(len(row.request.prompt) + row.generated - 1)
        token_rows.append(i)
    for i in prefilling:
        left = budget - len(tokens)
        if left <= 0:
            break
        row, prompt = rows[i], rows[i].request.prompt
        seg = prompt[row.offset : row.offset + min(left, chunk)]
        tokens += seg
        positions += range(row.offset, row.offset + len(seg))
        token_rows += [i] * len(seg)
        advance[i] = row.offset + len(seg)
        if advance[i] == len(prompt):
            emit.append((i, len(tokens) - 1, row.request.index, 0))
    n = max(token_rows) + 1
    return Pass(
        group,
        0,
        n,
        len(tokens),
        [tokens],
        [positions],
        decode[:n],
        emit=emit,
        advance=advance,
        token_rows=token_rows,
        token_major=True,
    )


def pad_mixed_pass(p: Pass, tokens: int) -> None:
    """Pad a mixed pass in place to `tokens` tokens (a token-count class of the mixed graph block, >= p.T): its
    tokens, positions and token_rows [1, T] -> [1, tokens]. Padding tokens sit at position -1 in row 0 of the pass,
    so each writes only row 0's trash row (`cache_slots`), and their indexer scores and attention read only their
    own query: no real token's keys, top-k or output depend on them (tokens attend per query; MoE routing is
    dropless). Nothing they compute is sampled: the emit columns stay where they were."""
    extra = tokens - p.T
    if extra < 0:
        raise ValueError(f"pad_mixed_pass: a pass of {p.T} tokens cannot be padded to {tokens}")
    p.tokens[0] += [0] * extra
    p.positions[0] += [-1] * extra
    p.token_rows += [0] * extra
    p.T = tokens
