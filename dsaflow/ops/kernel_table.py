"""The dispatch shape every op shares: an ordered table of (kernel name, capability rule).

A rule takes the op's inputs and returns None when its kernel runs them, else the reason it does not. The op's
dispatch walks its table and runs the first kernel whose rule accepts; `Choice` keeps the reasons of the candidates
refused before it, so `explain_<op>(...)` can say which kernel a call runs and why the earlier ones did not.
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
