"""The dispatch shape every op shares: an ordered table of (kernel name, capability rule).

A rule takes the op's inputs and returns None when its kernel runs them, else the reason it does not. Each op's
`dispatch.py` holds its table and one dispatch function, `explain_<op>(...)`, which walks the table and returns a
`Choice`: the first kernel whose rule accepts, and the reasons of the candidates refused before it. The op runs
`chosen(...)` of that choice, so the rule that explains a call is the rule that picks its kernel.
Rules depend on shapes, dtypes, the device and process-wide switches only (never on tensor values), so a captured
CUDA graph always replays the kernel it was captured with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Rule = Callable[..., "str | None"]


@dataclass(frozen=True)
class Choice:
    """The kernel a call runs (None: no candidate accepts) and (name, reason) for each candidate refused before it."""

    kernel: str | None
    refused: tuple[tuple[str, str], ...]

    def reasons(self) -> str:
        return "; ".join(f"{name}: {reason}" for name, reason in self.refused)

    def __str__(self) -> str:
        head = f"runs {self.kernel}" if self.kernel else "no kernel takes these inputs"
        return head + (f" (refused: {self.reasons()})" if self.refused else "")


def walk(
    table: Sequence[tuple[str, Rule]], *args, allowed: frozenset[str] | None = None, excluded_by: str = ""
) -> Choice:
    """The first entry of `table` whose rule accepts `args`. `allowed` (a forced subset) refuses every other name
    with `excluded_by` as its reason, without asking its rule."""
    refused = []
    for name, rule in table:
        reason = excluded_by if allowed is not None and name not in allowed else rule(*args)
        if reason is None:
            return Choice(name, tuple(refused))
        refused.append((name, reason))
    return Choice(None, tuple(refused))


def chosen(op: str, choice: Choice, inputs: str) -> str:
    """The name of the kernel `choice` runs, or ValueError `<op>: no kernel takes <inputs>: <each refusal>`: a call
    no kernel takes is an error, never a silent slow path."""
    if choice.kernel is None:
        raise ValueError(f"{op}: no kernel takes {inputs}: {choice.reasons()}")
    return choice.kernel


def describe(**tensors) -> str:
    """`name (shape) dtype, ...` of the tensors a refusal names."""
    return ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in tensors.items())
