"""The typed reader of a Hugging Face config.json: every field dsaflow uses is read through `ConfigJson`, which checks
its JSON type and range and, when they are wrong, raises one ConfigError naming the file, the key, the value as
written and what is allowed (exit 2; never a traceback later in the planner or a worker).

Types follow JSON, strictly: an integer field takes a JSON integer (a float without a fraction, such as 4096.0,
reads as that integer; 32.5, "32", true and null do not); a number field takes an integer or a finite float; a
flag takes true or false only; a text field takes a string from its allowed set; a section is a JSON object. A
field that is absent (or null, where it is optional) takes its default; a required one that is absent is named.
Ranges of fields that become a dsaflow config field are the schema's own (`schema_range`), so config.json can never
plan a model that `dsaflow.config.schema.validate` would refuse, and no size is used before it is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, List, Optional, Sequence

from dsaflow.errors import ConfigError

REQUIRED = object()
_SHOWN = 80


def show(value: Any) -> str:
    """`value` as config.json writes it (JSON), cut to about 80 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN // 2]}... ({len(text)} characters)"


def schema_range(cls, name: str) -> tuple:
    """(lo, hi, lo_open, hi_open) of the numeric schema field `cls.name` (dsaflow.config.fields.num)."""
    spec = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["range"]
    return spec[:4]


def _interval(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    return f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"


def _outside(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    return (lo is not None and (v <= lo if lo_open else v < lo)) or (
        hi is not None and (v >= hi if hi_open else v > hi)
    )


class ConfigJson:
    """A JSON object of config.json (the file, or a section of it such as rope_parameters), read field by field."""

    def __init__(self, raw: dict, path, prefix: str = ""):
        self.raw, self.path, self.prefix = raw, path, prefix

    def error(self, key: str, value, allowed: str) -> ConfigError:
        return ConfigError(
            f"{self.path}: {self.prefix}{key}={show(value)} is not allowed: {allowed}. Fix: set {self.prefix}{key} "
            "to that in config.json, or restore the checkpoint's config.json as published."
        )

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def value(self, key: str, default=REQUIRED):
        """The raw value; absent or null -> `default` (a required field that is absent is named)."""
        if self.raw.get(key) is not None:
            return self.raw[key]
        if default is REQUIRED:
            raise ConfigError(
                f"{self.path} has no {self.prefix}{key} (or it is null). Fix: restore the checkpoint's config.json."
            )
        return default

    def integer(self, key: str, lo=None, hi=None, default=REQUIRED, why: str = "") -> int:
        if not self.has(key):
            return self.value(key, default)
        v = self.raw[key]
        whole = type(v) is int or (type(v) is float and math.isfinite(v) and v.is_integer())
        if not whole or _outside(v, lo, hi, False, False):
            raise self.error(key, v, f"an integer in {_interval(lo, hi)}{why}")
        return int(v)

    def number(self, key: str, lo=None, hi=None, default=REQUIRED, lo_open=False, hi_open=False) -> float:
        if not self.has(key):
            return self.value(key, default)
        v = self.raw[key]
        ok = type(v) in (int, float) and math.isfinite(v) and not _outside(v, lo, hi, lo_open, hi_open)
        if not ok:
            raise self.error(key, v, f"a number in {_interval(lo, hi, lo_open, hi_open)}")
        return float(v)

    def schema_number(self, key: str, cls, name: str, default=REQUIRED):
        """The field `key` read with the type and range of the schema field `cls.name` (int or float)."""
        lo, hi, lo_open, hi_open = schema_range(cls, name)
        is_int = isinstance(next(f for f in dataclasses.fields(cls) if f.name == name).default, int)
        if is_int and not lo_open and not hi_open:
            return self.integer(key, lo, hi, default)
        return self.number(key, lo, hi, default, lo_open, hi_open)

    def flag(self, key: str, default=REQUIRED) -> bool:
        if not self.has(key):
            return self.value(key, default)
        v = self.raw[key]
        if type(v) is not bool:
            raise self.error(key, v, "true or false")
        return v

    def text(self, key: str, allowed: Sequence[str], default=REQUIRED) -> str:
        if not self.has(key):
            return self.value(key, default)
        v = self.raw[key]
        if not isinstance(v, str) or v not in allowed:
            raise self.error(key, v, f"one of {', '.join(map(repr, allowed))}")
        return v

    def section(self, key: str) -> Optional[ConfigJson]:
        """The JSON object `key` as a ConfigJson (None when absent or null)."""
        v = self.value(key, None)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.error(key, v, "a JSON object")
        return ConfigJson(v, self.path, f"{self.prefix}{key}.")

    def words(self, key: str, allowed: Sequence[str], count: int) -> Optional[List[str]]:
        """A list of `count` strings, each from `allowed` (None when absent or null)."""
        v = self.value(key, None)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) != count or not all(isinstance(w, str) and w in allowed for w in v):
            raise self.error(
                key, v, f"a list of {count} entries (one per layer), each one of {', '.join(map(repr, allowed))}"
            )
        return v
