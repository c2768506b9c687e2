"""The only module that reaches into Hydra's private API; everything else uses Hydra's public API.

Hydra's public entry, `@hydra.main`, reads `sys.argv` and owns the process's exit. dsaflow's parent needs three
things it does not offer, so they come from `hydra._internal` here and nowhere else:

- `hydra_args_parser()`: Hydra's own command-line parser (-m, --cfg, --info, -sc, overrides), so that the flags
  mean exactly what they mean in any Hydra app;
- `hydra_run_app(args, parser, task, config_dir)`: Hydra's app runner on parsed arguments (what `@hydra.main` calls
  after parsing `sys.argv`): sweeps, the sweeper and launcher plugins, `--cfg`, `--info`, shell completion;
- `basic_sweep_jobs(overrides)`: the basic sweeper's expansion of a sweep into jobs, so that every job's config is
  composed before the first starts.

pyproject.toml pins hydra-core to the range these were checked against, and tests/test_hydra_private.py fails when
one of them changes its signature or behaviour.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, List

HYDRA_VERSIONS = (">=1.3.2", "<1.4")  # keep in step with pyproject.toml's hydra-core pin


def hydra_args_parser() -> argparse.ArgumentParser:
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def hydra_run_app(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    task: Callable[[Any], Any],
    config_dir: str,
    config_name: str = "config",
) -> None:
    """Run Hydra's app runner with `task` as the task function. Errors end in SystemExit (Hydra prints them)."""
    from hydra._internal.utils import _run_hydra

    _run_hydra(args=args, args_parser=parser, task_function=task, config_path=config_dir, config_name=config_name)


def basic_sweep_jobs(overrides: List[str]) -> List[List[str]]:
    """The basic sweeper's jobs for `overrides` (`a=1,2 b=x` -> [["a=1", "b=x"], ["a=2", "b=x"]]).
    Raises Hydra's own errors for bad grammar or sweeps."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return batches[0] if batches else [[]]
