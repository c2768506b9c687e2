"""The translation of OmegaConf's exceptions into one paragraph that names the key, the value and the fix (raised
as `dsaflow.errors.ConfigError` by dsaflow.config.compose)."""

from __future__ import annotations

import dataclasses

__all__ = ["explain_omegaconf_error"]


def _fields(object_type) -> dict:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return {f.name: f.type for f in dataclasses.fields(object_type)}
    return {}


def explain_omegaconf_error(exc) -> str:
    """One paragraph from an OmegaConfBaseException (uses its full_key / key / value / object_type)."""
    full_key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    first_line = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
    fields = _fields(getattr(exc, "object_type", None))
    owner = getattr(getattr(exc, "object_type", None), "__name__", "the config")
    name = type(exc).__name__
    if name in ("ConfigAttributeError", "ConfigKeyError") and "not in" in first_line:
        valid = ", ".join(fields) if fields else "see dsaflow/config/schema.py"
        return (
            f"unknown key {full_key}: {owner} has no field {getattr(exc, 'key', full_key)!r}. Fix: remove it or use "
            f"one of its fields: {valid}."
        )
    key = getattr(exc, "key", None)
    want = fields.get(key) if isinstance(key, str) else None
    value = getattr(exc, "value", None)
    if "is not Optional" in first_line:
        kind = want or "its declared type"
        return f"{full_key}=null: this field needs a value. Fix: set {full_key} to a value of type {kind}."
    if name == "ValidationError" and "expected one of" in first_line:
        allowed = first_line.split("expected one of", 1)[1].strip(" []")
        return f"{full_key}={value!r} is not a valid choice. Fix: use one of {allowed}."
    if name == "ValidationError":
        kind = f"of type {want}" if want else "of the type declared in dsaflow/config/schema.py"
        return f"{full_key}={value!r}: {first_line}. Fix: give {full_key} a value {kind}."
    return f"{full_key}: {first_line}. Fix: check the key and value against dsaflow/config/schema.py."
