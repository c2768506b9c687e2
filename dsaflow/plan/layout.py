"""The layout language: layer roles and stage boundaries in one string.

Grammar (whitespace is ignored everywhere):

    layout := item*
    item   := "F" | "S" | "|" | atom "*" count
    atom   := "F" | "S" | "(" layout ")"
    count  := positive integer

`F` = a layer that runs its own indexer, `S` = a layer that reuses the indices of the nearest preceding F layer on
its stage, `|` = a stage boundary. `(FSSS)*2 | (FSSS)*2` is 16 layers in two stages of 8.

Three ways to state roles, exactly one may be used (the planner rejects mixtures):
  * `layout`                      roles and, optionally, stage boundaries;
  * `index.pattern`               a layout without `|`, tiled over the layers and cut at `model.num_layers`;
  * `index.freq` + `index.offset` layer i is F iff i < offset or (i - offset) % freq == 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from dsaflow.errors import PlanError

ROLES = ("F", "S")
# Bounds that keep hostile input from exhausting memory or the stack (model.num_layers is at most 1024).
MAX_CHARS = 10_000
MAX_DEPTH = 16
MAX_TOKENS = 1 << 16  # layers and boundaries after expanding every repeat
MAX_COUNT_DIGITS = 6


@dataclass(frozen=True)
class ParsedLayout:
    """roles[i] is "F" or "S"; stage_starts lists the first layer of every stage (starts with 0)."""

    roles: Tuple[str, ...]
    stage_starts: Tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_starts)

    @property
    def has_boundaries(self) -> bool:
        return len(self.stage_starts) > 1


def _error(field: str, text: str, pos: int, what: str, fix: str) -> PlanError:
    lo = max(0, pos - 40)  # a window around the position: a long layout stays one short paragraph
    shown = ("..." if lo else "") + text[lo : pos + 40] + ("..." if pos + 40 < len(text) else "")
    caret = " " * (pos - lo + (3 if lo else 0)) + "^"
    head = text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"
    return PlanError(f"{field}={head!r}: {what} at position {pos}:\n    {shown}\n    {caret}\n{fix}")


class _Parser:
    """Recursive descent over the raw string; expands repeats into a flat token list of F, S and |."""

    def __init__(self, text: str, field: str):
        self.text, self.field, self.pos = text, field, 0

    def _skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _peek(self) -> Optional[str]:
        self._skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else None

    def fail(self, what: str, fix: str, pos: Optional[int] = None) -> PlanError:
        return _error(self.field, self.text, self.pos if pos is None else pos, what, fix)

    def parse(self) -> List[str]:
        if len(self.text) > MAX_CHARS:
            raise PlanError(
                f"{self.field} is {len(self.text)} characters long, more than the {MAX_CHARS} a layout may "
                f"have. Fix: use repeats, e.g. {self.field}='(FSSS)*16'."
            )
        tokens = self._sequence(depth=0)
        if self._peek() is not None:  # only a stray ")" stops a top-level sequence early
            raise self.fail("unbalanced ')' with no matching '('", "Fix: remove the ')' or add the '(' it closes.")
        return tokens

    def _sequence(self, depth: int) -> List[str]:
        out: List[str] = []
        while True:
            ch = self._peek()
            if ch is None or ch == ")":
                return out
            if ch == "|":
                self.pos += 1
                out.append("|")
                continue
            out.extend(self._repeat(self._atom(depth)))
            if len(out) > MAX_TOKENS:
                raise self.fail(
                    f"the layout expands to more than {MAX_TOKENS} layers and boundaries",
                    "Fix: match the repeats to model.num_layers.",
                )

    def _atom(self, depth: int) -> List[str]:
        ch, start = self._peek(), self.pos
        if ch in ROLES:
            self.pos += 1
            return [ch]
        if ch == "(":
            if depth >= MAX_DEPTH:
                raise self.fail(
                    f"groups nest deeper than {MAX_DEPTH} levels",
                    "Fix: flatten the layout; a few levels of (..)*n describe any model.",
                )
            self.pos += 1
            inner = self._sequence(depth + 1)
            if self._peek() != ")":
                raise self.fail("unbalanced '(' is never closed", "Fix: add the missing ')'.", pos=start)
            self.pos += 1
            if not inner:
                raise self.fail("empty group '()'", "Fix: put layers (F/S) inside the parentheses.", pos=start)
            return inner
        if ch == "*":
            raise self.fail("'*' has nothing to repeat", "Fix: write (..)*n or F*n, e.g. (FSSS)*4.")
        raise self.fail(
            f"unknown role letter {ch!r}",
            "Fix: a layout uses only F (runs the indexer), S (reuses indices), '|' (stage boundary), "
            "'(..)*n' (repeat) and spaces.",
        )

    def _repeat(self, tokens: List[str]) -> List[str]:
        if self._peek() != "*":
            return tokens
        self.pos += 1
        self._skip_ws()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        digits = self.text[start : self.pos]
        if not digits:
            raise self.fail("'*' must be followed by a repeat count", "Fix: write e.g. (FSSS)*4.", pos=start)
        if len(digits.lstrip("0")) > MAX_COUNT_DIGITS:
            raise self.fail(
                f"repeat count {digits[:12]}{'...' if len(digits) > 12 else ''} is too large",
                f"Fix: a layout has at most {MAX_TOKENS} layers; use a count below that.",
                pos=start,
            )
        count = int(digits)
        if count < 1:
            raise self.fail("repeat count must be at least 1", "Fix: use a positive count, e.g. *2.", pos=start)
        if len(tokens) * count > MAX_TOKENS:
            raise self.fail(
                f"this repeat expands to {len(tokens) * count} layers and boundaries, more than the "
                f"{MAX_TOKENS} a layout may have",
                "Fix: match the count to model.num_layers.",
                pos=start,
            )
        return tokens * count


def parse_layout(text: str, field: str = "layout") -> ParsedLayout:
    """Parse a layout string into roles and stage starts; raises PlanError naming `field`, the position and the fix."""
    tokens = _Parser(text, field).parse()
    roles: List[str] = []
    starts = [0]
    for tok in tokens:
        if tok == "|":
            if len(roles) == starts[-1]:
                raise PlanError(
                    f"{field}={text!r}: stage {len(starts) - 1} is empty (a '|' at the start, at the end, or two "
                    "'|' with no layer between them). Fix: every stage needs at least one layer; remove the extra '|'."
                )
            starts.append(len(roles))
        else:
            roles.append(tok)
    if not roles:
        raise PlanError(f"{field}={text!r}: the layout has no layers. Fix: write F/S letters, e.g. {field}='(FSSS)*2'.")
    if len(roles) == starts[-1]:
        raise PlanError(
            f"{field}={text!r}: the last stage is empty (the layout ends with '|'). Fix: remove the trailing '|'."
        )
    return ParsedLayout(tuple(roles), tuple(starts))


def tile_pattern(pattern: str, num_layers: int, field: str = "index.pattern") -> Tuple[str, ...]:
    """Roles from a pattern tiled over `num_layers` (the last repetition is cut short)."""
    parsed = parse_layout(pattern, field)
    if parsed.has_boundaries:
        raise PlanError(
            f"{field}={pattern!r}: a pattern describes roles only and cannot contain '|'. Fix: put stage boundaries "
            "in pipeline.boundaries, or write the whole model as the top-level `layout` string."
        )
    reps = -(-num_layers // len(parsed.roles))
    return tuple((parsed.roles * reps)[:num_layers])


def freq_roles(freq: int, offset: int, num_layers: int) -> Tuple[str, ...]:
    """SGLang/vLLM `index_topk_freq` semantics: layer i is F iff i < offset or (i - offset) % freq == 0."""
    if freq < 1:
        raise PlanError(f"index.freq={freq}: must be >= 1. Fix: index.freq=4 runs the indexer on every 4th layer.")
    if offset < 0:
        raise PlanError(f"index.offset={offset}: must be >= 0. Fix: index.offset=0 (the default).")
    return tuple("F" if i < offset or (i - offset) % freq == 0 else "S" for i in range(num_layers))


def format_layout(roles: Tuple[str, ...], stage_starts: Tuple[int, ...]) -> str:
    """The inverse of parse_layout (no repeats): "FSSS|SSFS"."""
    bounds = list(stage_starts[1:]) + [len(roles)]
    parts, lo = [], 0
    for hi in bounds:
        parts.append("".join(roles[lo:hi]))
        lo = hi
    return "|".join(parts)
