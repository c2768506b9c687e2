"""The Hydra internals dsaflow relies on (dsaflow/config/hydra_private.py), checked against the installed Hydra: a
new Hydra that renames or changes one of them fails here, not in a user's sweep."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import hydra
import pytest
from hydra.errors import OverrideParseException

from dsaflow.config.hydra_private import HYDRA_VERSIONS, basic_sweep_jobs, hydra_args_parser, hydra_run_app

REPO = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_installed_hydra_is_inside_the_pinned_range_and_pyproject_pins_the_same():
    low, high = (v.lstrip("<>=") for v in HYDRA_VERSIONS)
    assert _version(low) <= _version(hydra.__version__) < _version(high), hydra.__version__
    assert f'"hydra-core{HYDRA_VERSIONS[0]},{HYDRA_VERSIONS[1]}"' in (REPO / "pyproject.toml").read_text()


def test_hydra_args_parser_reads_the_flags_dsaflow_hands_it():
    args = hydra_args_parser().parse_args(["-m", "--cfg", "job", "--resolve", "a=1,2", "b=x"])
    assert (args.multirun, args.cfg, args.resolve, args.overrides) == (True, "job", True, ["a=1,2", "b=x"])
    args = hydra_args_parser().parse_args(["-sc", "query=bash"])
    assert args.shell_completion and args.overrides == ["query=bash"]
    assert hydra_args_parser().parse_args(["--info", "defaults"]).info == "defaults"


def test_basic_sweep_jobs_expands_grids_and_ranges_in_order():
    assert basic_sweep_jobs(["a=1,2", "b=x"]) == [["a=1", "b=x"], ["a=2", "b=x"]]
    assert basic_sweep_jobs(["s=range(0,3)"]) == [["s=0"], ["s=1"], ["s=2"]]
    assert basic_sweep_jobs([]) == [[]]
    with pytest.raises(OverrideParseException):
        basic_sweep_jobs(["a=(unclosed"])


def test_run_hydra_keeps_its_signature():
    from hydra._internal.utils import _run_hydra

    params = inspect.signature(_run_hydra).parameters
    assert {"args", "args_parser", "task_function", "config_path", "config_name"} <= set(params)


def test_hydra_run_app_runs_the_task_once_per_job_with_the_composed_config(tmp_path):
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "config.yaml").write_text("a: 0\nb: x\n")
    seen = []
    parser = hydra_args_parser()
    args = parser.parse_args(["-m", "a=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.job.chdir=false"])
    GlobalHydra.instance().clear()
    try:
        hydra_run_app(args, parser, lambda cfg: seen.append((cfg.a, cfg.b)), str(tmp_path))
    finally:
        GlobalHydra.instance().clear()
    assert seen == [(1, "x"), (2, "x")]
