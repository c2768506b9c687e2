"""A run dir is the source of truth for the settings it was trained with.

Resuming a run, serving its checkpoint and searching its layers read the run's `config.yaml` and take from the
command line only what the user changes there:

    dsaflow train train.resume=true run_dir=RUN      every training setting of RUN (pipeline, train.ckpt_every, ...)
    dsaflow generate serve.checkpoint=RUN            RUN's model and layout (index.*, layout)
    dsaflow search search.checkpoint=RUN             RUN's model and data

An override of a section the run supplies replaces what it names (`train.steps=600` that field; `pipeline=pp4`
the whole group). A model given on the command line must be the run's: weights fit only the model they were
trained as, so a different one is an error naming the field, both values and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List, Optional, Tuple

from omegaconf import OmegaConf

from dsaflow.config.schema import DSAFlowConfig, validate
from dsaflow.errors import ConfigError

CONFIG = "config.yaml"
# Sections each reader takes from the run. `layout` and `index` say the same thing (which layers are F): they are
# taken, or given, together.
RUN_SECTIONS = {
    "resume": (
        "model",
        "index",
        "layout",
        "pipeline",
        "parallel",
        "graphs",
        "train",
        "data",
        "track",
        "launch",
        "extra",
    ),
    "serve": ("model", "index", "layout"),
    "search": ("model", "data"),
}
LINKED = {"index": ("index", "layout"), "layout": ("index", "layout")}


def run_source(cfg: DSAFlowConfig, command: str) -> Optional[Tuple[str, str, str]]:
    """(reader, field, path) when this command reads a run: resume, serve or search; else None."""
    if command == "train" and cfg.train.resume and cfg.run_dir:
        return "resume", "run_dir", cfg.run_dir
    if (command == "generate" or (command == "plan" and str(cfg.mode) == "serve")) and cfg.serve.checkpoint:
        return "serve", "serve.checkpoint", cfg.serve.checkpoint
    if command == "search" and cfg.search.checkpoint:
        return "search", "search.checkpoint", cfg.search.checkpoint
    return None


def run_dir_of(path: str) -> Optional[Path]:
    """The run dir of a run dir or of one of its checkpoint folders (RUN/checkpoints/step-N); None if neither
    holds a config.yaml (the command's own checks then say what is wrong with the path)."""
    p = Path(path)
    for candidate in (p, p.parent.parent) if p.parent.name == "checkpoints" else (p,):
        if os.path.isfile(candidate / CONFIG):
            return candidate
    return None


def touched_paths(overrides: List[str]) -> List[Tuple[str, str]]:
    """(dotted key, override text) of each override: `train.steps=5` -> train.steps; `pipeline=pp2` -> pipeline."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dsaflow.config.compose import quote_layout_overrides

    parsed = OverridesParser.create().parse_overrides(quote_layout_overrides(list(overrides)))
    return [(p.key_or_group.replace("/", "."), p.input_line) for p in parsed]


def _model_mismatch(run_model, given_model, field: str, path: str, touched) -> Optional[str]:
    old, new = dataclasses.asdict(run_model), dataclasses.asdict(given_model)
    diff = [k for k in new if k != "name" and str(old.get(k)) != str(new[k])]
    if not diff:
        return None
    words = [text for key, text in touched if key == "model" or key in {f"model.{k}" for k in diff}]
    pairs = "; ".join(f"model.{k} is {old.get(k)!r} in the run, {new[k]!r} as given" for k in diff[:3])
    more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
    return (
        f"{' '.join(words)}: {field}={path} was trained with model={old.get('name')}, and its weights fit only that "
        f"model: {pairs}{more}. Fix: drop {' '.join(words)} (the run's model is used), or point {field} at a run "
        f"of model={new.get('name')}."
    )


def settings_from_run(cfg: DSAFlowConfig, overrides: List[str], command: str) -> DSAFlowConfig:
    """`cfg` (composed from `overrides`) with the sections a run supplies read from that run, except where the
    overrides change them. Returns cfg itself when the command reads no run or the path has no config.yaml."""
    from dsaflow.config.compose import honour_wandb_mode, load_config

    source = run_source(cfg, command)
    run_dir = run_dir_of(source[2]) if source else None
    if run_dir is None:
        return cfg
    reader, field, path = source
    sections = RUN_SECTIONS[reader]
    run_cfg = load_config(run_dir / CONFIG)
    touched = touched_paths(overrides)
    given = {key.split(".")[0] for key, _ in touched}
    for key in list(given):
        given.update(LINKED.get(key, ()))
    out, old, new = OmegaConf.structured(cfg), OmegaConf.structured(run_cfg), OmegaConf.structured(cfg)
    for section in sections:
        if section not in given:
            out[section] = old[section]
            continue
        keys = [key for key, _ in touched if key.split(".")[0] == section]
        if keys and all("." in key for key in keys) and OmegaConf.is_dict(old[section]):
            out[section] = old[section]  # changed in part: the run's values, then the user's keys
            for key in keys:
                OmegaConf.update(out, key, OmegaConf.select(new, key), merge=False)
    merged = OmegaConf.to_object(out)
    if "model" in sections and "model" in given:  # the run's model with the user's changes must still be the run's
        problem = _model_mismatch(run_cfg.model, merged.model, field, path, touched)
        if problem:
            raise ConfigError(problem)
    validate(merged)
    honour_wandb_mode(merged)
    return merged
