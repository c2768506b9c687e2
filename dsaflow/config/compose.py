"""Compose the typed config: Hydra in the parent process, plain OmegaConf in workers.

`compose(overrides)` runs Hydra's compose API over `configs/` (or $DSAFLOW_CONFIG_DIR) and returns a
`DSAFlowConfig`; Hydra/OmegaConf failures (unknown key, wrong type, missing group option, bad override syntax)
become a `ConfigError` naming the key, the value and the fix. Workers never import Hydra: they read the run dir's
resolved `config.yaml` with `load_config`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import dsaflow
from dsaflow.config.field_checks import check_override_numbers
from dsaflow.config.omegaconf_errors import explain_omegaconf_error
from dsaflow.config.schema import DSAFlowConfig, register_configs, validate
from dsaflow.errors import ConfigError

# Values written in the layout language contain characters that Hydra's override grammar reserves ("(", ")", "|",
# spaces); these keys are quoted for Hydra so `layout=(FSSS)*2|(FSSS)*2` works as typed.
LAYOUT_KEYS = ("layout", "index.pattern")
_OVERRIDE_KEY = re.compile(r"^(\+{0,2})([\w.]+)=(.*)$", re.S)


# Former config keys that are now options of the command (`dsaflow plan --format`, `dsaflow train --nproc`).
COMMAND_KEYS = ("nproc", "format")


def default_config_dir() -> Path:
    env = os.environ.get("DSAFLOW_CONFIG_DIR")
    return Path(env) if env else Path(dsaflow.__file__).resolve().parents[1] / "configs"


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def quote_layout_overrides(overrides: List[str]) -> List[str]:
    """Quote layout values for Hydra. The layout language has no commas, so `layout=A,B` is a sweep over two
    layouts (with -m): each part is quoted on its own."""
    out = []
    for ov in overrides:
        m = _OVERRIDE_KEY.match(ov)
        if m and m.group(2) in LAYOUT_KEYS:
            value = m.group(3)
            if value and value not in ("null", "None") and value[0] not in "'\"":
                ov = f"{m.group(1)}{m.group(2)}=" + ",".join(_quote(v) for v in value.split(","))
        out.append(ov)
    return out


def sweep_overrides(overrides: List[str]) -> List[str]:
    """The overrides that are Hydra sweeps (`a=1,2`, `range(..)`, `choice(..)`, `glob(..)`); [] if the syntax is
    not parseable (compose then explains the mistake)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(quote_layout_overrides(list(overrides)))
    except Exception:  # noqa: BLE001 - any syntax error is reported by compose with its fix
        return []
    return [p.input_line for p in parsed if p.is_sweep_override()]


def refuse_sweeps(overrides: List[str]) -> None:
    """A single run given sweep syntax: say how to sweep, how to write a list, how to write a string."""
    sweeps = sweep_overrides(overrides)
    if sweeps:
        key = sweeps[0].split("=", 1)[0].lstrip("+~")
        raise ConfigError(
            f"{sweeps[0]} is a sweep (one job per value). Fix: add -m (--multirun) to run one job per value, one "
            f"after another; for a list value write {key}=[a,b]; for a string containing a comma quote it: "
            f"{key}=\"'a,b'\"."
        )


def _group_options(config_dir: Path, group: str) -> List[str]:
    d = config_dir / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _explain_hydra_error(exc: Exception, config_dir: Path) -> str:
    """Turn a Hydra exception into one paragraph: what was wrong, and the fix."""
    text = str(exc).strip()
    cause = exc
    while not isinstance(cause, OmegaConfBaseException) and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__  # Hydra raises from inside `except`, so follow __context__ too
    if isinstance(cause, OmegaConfBaseException):
        where = re.match(r"In '([^']+)'", text)  # the group file being merged, e.g. model/typo
        prefix = f"in {config_dir / where.group(1)}.yaml: " if where else ""
        return prefix + explain_omegaconf_error(cause)
    m = re.search(r"Could not find '([\w/]+)/([^']+)'", text) or re.search(r"Could not load '([\w/]+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        opts = _group_options(config_dir, group)
        return (
            f"{group}={option}: there is no option {option!r} in the config group {group!r} ({config_dir / group}). "
            f"Fix: use one of {', '.join(opts) if opts else '(none found)'}."
        )
    first = " ".join(text.split())
    groups = sorted(p.name for p in config_dir.iterdir() if p.is_dir()) if config_dir.is_dir() else []
    return (
        f"could not compose the config: {first} Fix: overrides are key=value (e.g. model.dim=128), group=option "
        f"(groups: {', '.join(groups)}) or +new_key=value; quote values that contain spaces or brackets."
    )


def check_group_overrides(overrides: List[str], config_dir: Path) -> None:
    """A config group takes an option's name: `pipeline=2` or `train=null` would reach Hydra as a number or null,
    which it reports with a traceback. Say which options exist instead (sweeps are checked job by job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(quote_layout_overrides(list(overrides)))
    except Exception:  # noqa: BLE001 - a syntax error is reported by compose with its fix
        return
    for p in parsed:
        key = p.key_or_group
        if not key:
            raise ConfigError(
                f"{p.input_line}: the override has no key before '='. Fix: write key=value, e.g. train.steps=5 "
                "or pipeline=pp2."
            )
        if p.is_sweep_override() or p.is_delete() or not (config_dir / key).is_dir():
            continue
        value = p.value()
        if not isinstance(value, str):
            shown = "null" if value is None else str(value)
            opts = ", ".join(_group_options(config_dir, key))
            raise ConfigError(
                f"{key}={shown}: {key} is a config group, which takes the name of one of its options, and {shown} "
                f"is not one. Fix: use one of {opts}; to set one field write {key}.NAME=VALUE (e.g. {_field_example(key)})."
            )


def _field_example(group: str) -> str:
    examples = {"pipeline": "stages=2", "model": "num_layers=16", "index": "freq=4", "train": "steps=100"}
    return f"{group}.{examples.get(group, 'NAME=VALUE')}"


def _unknown_keys(node, schema, prefix: str = "") -> List[str]:
    """Keys in a composed DictConfig that its dataclass does not declare. Hydra lets `+key=value` add them even to
    a typed config, and OmegaConf.to_object then drops them silently: a typo would be ignored, so we refuse it."""
    import dataclasses
    import typing

    if not (dataclasses.is_dataclass(schema) and OmegaConf.is_dict(node)):
        return []
    hints = typing.get_type_hints(schema)
    out = []
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in hints:
            out.append(path)
            continue
        hint = hints[key]
        child = node._get_node(key)
        if dataclasses.is_dataclass(hint):
            out += _unknown_keys(child, hint, path + ".")
        elif typing.get_origin(hint) in (list, typing.List) and OmegaConf.is_list(child):
            (item,) = typing.get_args(hint) or (None,)
            for i, sub in enumerate(child):
                out += _unknown_keys(sub, item, f"{path}[{i}].")
    return out


# Fills the model from where `model.hf_path` points (the commands pass dsaflow.checkpoint.hf_config.apply_hf_model,
# a room above this one); it runs before validation, so the model it sets is checked like any other.
ModelSource = Callable[[DSAFlowConfig], None]


def compose(
    overrides: Optional[List[str]] = None, config_dir: Optional[str] = None, model_source: Optional[ModelSource] = None
) -> DSAFlowConfig:
    """Hydra-compose `configs/config.yaml` with `overrides` and return the typed DSAFlowConfig (`model_source`:
    see ModelSource)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    cdir = Path(config_dir) if config_dir else default_config_dir()
    if not (cdir / "config.yaml").is_file():
        raise ConfigError(
            f"config dir {cdir} has no config.yaml. Fix: point DSAFLOW_CONFIG_DIR at the repository's configs/ folder."
        )
    check_override_numbers(overrides or [])
    check_group_overrides(list(overrides or []), cdir)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir.resolve()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=quote_layout_overrides(list(overrides or [])))
        out = typed_config(cfg, model_source)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_hydra_error(exc, cdir)) from None
    finally:
        GlobalHydra.instance().clear()
    return out


def typed_config(cfg, model_source: Optional[ModelSource] = None) -> DSAFlowConfig:
    """A composed DictConfig (from `compose`, or the one Hydra hands a multirun job) -> DSAFlowConfig. Keys the
    schema does not declare are refused (OmegaConf.to_object would drop them silently)."""
    unknown = _unknown_keys(cfg, DSAFlowConfig)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]} (all unknown: {', '.join(unknown)}): the schema in dsaflow/config/schema.py "
            "does not declare it, so it would be ignored. Fix: remove it or correct its spelling; free-form "
            "metadata goes under `+extra.<name>=...`."
        )
    out = OmegaConf.to_object(cfg)
    if model_source is not None:
        model_source(out)
    validate(out)  # ranges and choices, declared in schema.py: a ConfigError naming field, value and range
    honour_wandb_mode(out)
    return out


def honour_wandb_mode(cfg: DSAFlowConfig) -> None:
    """WANDB_MODE=disabled, wandb's own off switch, turns tracking off as it would for any wandb script; the run
    dir's config.yaml then records track.mode=disabled (no wandb/ folder, no tracker on any rank)."""
    if os.environ.get("WANDB_MODE", "").lower() == "disabled" and str(cfg.track.backend) == "wandb":
        cfg.track.mode = type(cfg.track.mode)("disabled")


def to_yaml(cfg: DSAFlowConfig) -> str:
    """Resolved YAML of a typed config (what the run dir's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _small_tree(data, max_nodes: int = 100_000, max_depth: int = 16) -> bool:
    """YAML aliases can make a small file expand to an exponential tree: walk it with a node budget."""
    todo, seen = [(data, 1)], 0
    while todo:
        x, d = todo.pop()
        seen += 1
        if seen > max_nodes or d > max_depth:
            return False
        if isinstance(x, dict):
            todo.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            todo.extend((v, d + 1) for v in x)
    return True


def load_config(path) -> DSAFlowConfig:
    """Read a resolved config.yaml into a DSAFlowConfig with OmegaConf only (no Hydra): for workers. The file is
    read as a regular file (no link, no FIFO, bounded size); an empty or unparsable file is named as such."""
    import yaml

    from dsaflow.files import UnsafeFile, read_text

    from .literal import literal

    try:
        text = read_text(path)
    except UnsafeFile as exc:
        raise ConfigError(
            f"{exc}. Fix: point at a run dir written by `dsaflow train`, or start a new run_dir."
        ) from None
    if not text.strip():
        raise ConfigError(
            f"{path} is empty (truncated or overwritten), so the run's settings are unknown. Fix: "
            "restore it from a copy, or start a new run_dir."
        )
    try:
        data = yaml.safe_load(text)
        if not isinstance(data, dict) or not _small_tree(data):
            raise ConfigError(
                f"{path} is not a YAML mapping of config groups of a sane size (corrupted). Fix: "
                "restore it from a copy, or start a new run_dir."
            )
        loaded = OmegaConf.create(literal(data))  # plain values: resolved once, by the parent that wrote them
        for key in COMMAND_KEYS:  # run dirs written before these moved to the command line still load
            loaded.pop(key, None)
        merged = OmegaConf.merge(OmegaConf.structured(DSAFlowConfig), loaded)
        cfg = OmegaConf.to_object(merged)
        validate(cfg)
        return cfg
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: " + explain_omegaconf_error(exc)) from None
    except yaml.YAMLError as exc:
        first = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"{path} is not valid YAML ({first}); the file is corrupted. Fix: restore it from a copy, "
            "or start a new run_dir."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path} nests too deeply to be a dsaflow config (corrupted). Fix: start a new run_dir."
        ) from None
    except ConfigError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ConfigError(f"{path}: {exc}") from None
