"""`dsaflow plan | train | generate [hydra overrides]`: argument handling and user-error handling only.

Overrides are Hydra override strings: key=value, group=option, +key=value. A config or plan mistake prints one
paragraph to stderr and exits with status 2; it never shows a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from dsaflow.plan.plan import PlanError

EXIT_USER_ERROR = 2
EXAMPLES = """examples:
  dsaflow plan model=tiny layout="FSSS|SSFS"
  dsaflow plan model=dsv32 index=every4 pipeline=pp8
  dsaflow plan model=dsv32 index=every4 pipeline=pp8 format=json
  dsaflow plan model=small index.freq=4 index.offset=1 pipeline.boundaries=[0,5]
"""


def usage_epilog() -> str:
    """Override help listing the options that actually exist in the config dir (so it never goes stale)."""
    from dsaflow.config.compose import default_config_dir

    cdir = default_config_dir()
    groups = sorted(p for p in cdir.iterdir() if p.is_dir()) if cdir.is_dir() else []
    lines = ["overrides (Hydra syntax: key=value, group=option, +key=value); groups and options:"]
    for g in groups:
        lines.append(f"  {g.name}={'|'.join(sorted(p.stem for p in g.glob('*.yaml')))}")
    lines.append('  layout="(FSSS)*2|(FSSS)*2"  index.freq=4 index.offset=0  pipeline.boundaries=[0,4]  pipeline.stages=4')
    lines.append("  format=json (plan: print only the plan JSON)  mode=train|serve  estimate_context=131072")
    lines.append("see docs/planning.md for the layout language, the planner rules and the plan JSON contract.")
    return "\n".join(lines) + "\n\n" + EXAMPLES


def run_cli_errors(fn, *args) -> int:
    """Run fn; a PlanError (config or plan mistake) becomes its message on stderr and exit status 2."""
    try:
        return fn(*args) or 0
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def _compose_and_plan(overrides: List[str]):
    from dsaflow.config.compose import compose
    from dsaflow.plan import build_plan

    cfg = compose(overrides)
    return cfg, build_plan(cfg)


def cmd_plan(overrides: List[str]) -> int:
    from dsaflow.plan.render import render_table

    cfg, plan = _compose_and_plan(overrides)
    if cfg.format == "json":
        sys.stdout.write(plan.to_json() + "\n")
    else:
        sys.stdout.write(render_table(plan, cfg))
    return 0


def cmd_launch(job: str, overrides: List[str]) -> int:
    if job == "generate" and not any(o.lstrip("+").startswith("mode=") for o in overrides):
        overrides = ["mode=serve"] + overrides  # generating is serving: decode/prefill graph blocks are allowed
    cfg, plan = _compose_and_plan(overrides)
    try:
        from dsaflow.launch.launch import launch
    except ImportError as exc:
        print(f"dsaflow: error: `dsaflow {job}` needs dsaflow.launch.launch, which is not available ({exc}).",
              file=sys.stderr)
        return 1
    return launch(cfg, plan, job) or 0


def build_parser() -> argparse.ArgumentParser:
    epilog = usage_epilog()
    parser = argparse.ArgumentParser(
        prog="dsaflow",
        description="Plan, train and serve DSA transformers with IndexCache across pipeline stages.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{plan,train,generate}")
    helps = {
        "plan": "resolve and check the config; print the plan table (or format=json for the plan JSON)",
        "train": "plan, write the run dir, launch training (torchrun, one process per pipeline rank)",
        "generate": "plan, write the run dir, launch generation (sets mode=serve unless given)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra override: key=value, group=option, +key=value")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    if args.command == "plan":
        code = run_cli_errors(cmd_plan, args.overrides)
    else:
        code = run_cli_errors(cmd_launch, args.command, args.overrides)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
