"""Checks of string and list fields that a range cannot express, run by `schema.validate` on every config.

* Names that become part of a path (`model.name`, `data.name`, `track.run_name` make the default run dir
  runs/<time>-<name>): one folder name each, never a path: no `/` or `\\`, not `.` or `..`, no control
  characters, at most NAME_MAX characters. (The run dir itself is resolved and checked to stay under runs/.)
* Tracker fields, against wandb's own rules, before anything is written (wandb would refuse them in a worker):
  project and entity at most 128 characters without any of `/ \\ # ? % :`; group at most 128 characters; each
  tag 1 to 64 characters.
* train.betas and search.eval_ratios (lists, whose items a range cannot reach).
"""

from __future__ import annotations

import math

from dsaflow.errors import ConfigError, shown

NAME_MAX = 100
PATH_NAME_FIELDS = {"ModelConfig": ("name",), "DataConfig": ("name",), "TrackConfig": ("run_name",)}
WANDB_NAME_MAX, WANDB_TAG_MAX, WANDB_BAD_CHARS = 128, 64, "/\\#?%:"


def name_problem(value: str) -> str:
    """Why `value` cannot be one folder name ('' when it can)."""
    if not value or value in (".", ".."):
        return "is not a folder name"
    if len(value) > NAME_MAX:
        return f"is {len(value)} characters, more than {NAME_MAX}"
    bad = sorted({c for c in value if c in "/\\" or ord(c) < 32 or ord(c) == 127})
    if bad:
        return f"holds {''.join(bad)!r}, which would make it a path rather than one folder name"
    return ""


def check_path_names(cfg, prefix: str) -> None:
    for name in PATH_NAME_FIELDS.get(type(cfg).__name__, ()):
        value = getattr(cfg, name)
        if value is None:
            continue
        problem = name_problem(str(value))
        if problem:
            raise ConfigError(
                f"{prefix}{name}={shown(str(value))} {problem}; it names the run dir runs/<time>-<name>. Fix: a plain "
                f"name of letters, digits, '-', '_' or '.' (at most {NAME_MAX} characters), e.g. {prefix}{name}=exp1."
            )


def check_tracker(t, prefix: str) -> None:
    for name in ("project", "entity", "group"):
        value = getattr(t, name)
        if value is None:
            continue
        value = str(value)
        bad = sorted({c for c in value if c in WANDB_BAD_CHARS}) if name != "group" else []
        if not value or len(value) > WANDB_NAME_MAX or bad:
            why = f"holds {''.join(bad)!r}" if bad else f"is {len(value)} characters"
            chars = f" and none of {' '.join(WANDB_BAD_CHARS)}" if name != "group" else ""
            raise ConfigError(
                f"{prefix}{name}={shown(value)} {why}; wandb accepts 1 to {WANDB_NAME_MAX} characters{chars}. Fix: "
                f"e.g. {prefix}{name}=dsaflow-exp (or track=none)."
            )
    for i, tag in enumerate(t.tags or []):
        if not 1 <= len(str(tag)) <= WANDB_TAG_MAX:
            raise ConfigError(
                f"{prefix}tags[{i}]={shown(str(tag))} is {len(str(tag))} characters; wandb tags are 1 to "
                f"{WANDB_TAG_MAX}. Fix: a shorter tag."
            )


def check_lists(cfg, prefix: str) -> None:
    kind = type(cfg).__name__
    if kind == "SearchConfig":
        ratios = list(cfg.eval_ratios)
        if len(ratios) > 64 or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and 0 < r <= 1 for r in ratios
        ):
            raise ConfigError(
                f"{prefix}eval_ratios={shown(str(ratios))}: each must lie in (0, 1] (the fraction of F layers of a "
                f"uniform layout), at most 64 of them. Fix: e.g. {prefix}eval_ratios=[0.5,0.25]."
            )
    if kind == "TrainConfig":
        betas = list(cfg.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ConfigError(
                f"{prefix}betas={shown(str(betas))}: AdamW needs two betas, each in [0, 1). Fix: e.g. "
                f"{prefix}betas=[0.9,0.95]."
            )


def check_fields(cfg, prefix: str = "") -> None:
    """The checks above that apply to this group (`cfg` is any schema dataclass; prefix e.g. 'track.')."""
    check_path_names(cfg, prefix)
    if type(cfg).__name__ == "TrackConfig":
        check_tracker(cfg, prefix)
    check_lists(cfg, prefix)


def check_override_numbers(overrides) -> None:
    """A key=<thousands of digits> override, refused before Hydra parses it (Python refuses int() of more than 4300
    digits with a traceback, and no field takes more than 20)."""
    for ov in overrides:
        key, _, value = str(ov).partition("=")
        digits = value.strip().lstrip("+-")
        if len(digits) > 30 and digits.isdigit():
            raise ConfigError(
                f"{key.lstrip('+~')}={shown(value, 40)} is far beyond every field's range (no field takes more than "
                "20 digits). Fix: see the field's range in `dsaflow COMMAND --help`."
            )


def upper_bound(group, name: str):
    """The schema's upper bound of a numeric field (None when unbounded), for fix hints that stay in range."""
    import dataclasses

    spec = next(f for f in dataclasses.fields(group) if f.name == name).metadata.get("range")
    return spec[1] if spec else None
