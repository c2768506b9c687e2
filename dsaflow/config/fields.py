"""How a config field declares its allowed values: a `Choice` enum, or a numeric range (read by
`schema.validate`)."""

from __future__ import annotations

from dataclasses import field
from enum import Enum


def num(default, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False, even: bool = False, why: str = ""):
    """A numeric field with its allowed range [lo, hi] (open ends with lo_open/hi_open; None = unbounded)."""
    return field(default=default, metadata={"range": (lo, hi, lo_open, hi_open, even, why)})


class Choice(str, Enum):
    """A string choice: compares, hashes, formats and serialises as its plain value (member name == value)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def make_choice(name: str, values, module: str) -> type:
    """A Choice enum `name` of `values`, defined as if in `module` (where it must be importable: pickling and
    OmegaConf find it there by name)."""
    return Choice(name, {v: v for v in values}, module=module, qualname=name)
