"""User-error types: a leaf module that imports nothing of dsaflow, so config/, plan/ and runtime/ can all raise
them without import cycles. Every one is a `PlanError` (a ValueError): the CLI prints its one-paragraph message
(field, value, fix) and exits with status 2, never a traceback."""

from __future__ import annotations

EXIT_USER_ERROR = 2  # a config, plan, data or checkpoint mistake: nothing started, or a worker stopped cleanly
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM to the parent (128 + SIGINT, as shells report Ctrl-C)


class PlanError(ValueError):
    """A config or plan mistake. The message names the field, the value and the fix; the CLI prints it and exits 2."""


class ConfigError(PlanError):
    """The config could not be composed or read (unknown key, wrong type, value out of range, missing option)."""


class ServeError(PlanError):
    """A serving config or request mistake; names field, value, fix."""


class CheckpointError(PlanError):
    """A checkpoint that cannot be used (missing, partial, corrupt, another model, or unsafe to unpickle)."""


class ResourceError(PlanError):
    """The plan cannot fit this machine (memory per rank) or asks for sizes no machine can hold."""


def shown(value, limit: int = 80) -> str:
    """`value` as a user error quotes it: its repr, cut to about `limit` characters with its full length named, so
    a rejected 10 MB prompt or a 5000-digit number costs one line, never a screenful."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    head = text[: limit // 2]
    return f"{head!r}... ({len(text)} characters)" if isinstance(value, str) else f"{head}... ({len(text)} digits)"
