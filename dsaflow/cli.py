"""`dsaflow plan | train | generate | search [options] [hydra overrides]`: argument handling and user errors only.

Overrides are Hydra override strings: key=value, group=option, +key=value. Hydra's own flags work as in any Hydra
app (`--cfg job|all [--resolve]`, `--info`, `--hydra-help`, `-m/--multirun` with sweeps such as `a=1,2` or
`range(..)`): see dsaflow.app. A config or plan mistake prints one paragraph to stderr and exits with
status 2; it never shows a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

from dsaflow.errors import EXIT_USER_ERROR, PlanError

COMMANDS = {
    "plan": "resolve and check the config; print the plan table (--format json: only the plan JSON)",
    "train": "plan, write the run dir, launch training (torchrun, one process per pipeline rank)",
    "generate": "plan, write the run dir, launch generation (sets mode=serve unless given)",
    "serve": "plan, launch the pipeline and an OpenAI-compatible HTTP server in front of it (mode=serve)",
    "search": "training-free IndexCache layer search: which layers keep their indexer (from an all-F checkpoint)",
    "export": "write a run's model as a Hugging Face checkpoint that transformers' from_pretrained loads",
}
EXAMPLES = {
    "plan": """examples:
  dsaflow plan model=tiny layout="FSSS|SSFS"
  dsaflow plan model=dsv32 index=every4 pipeline=pp8
  dsaflow plan --format json model=dsv32 index=every4 pipeline=pp8
  dsaflow plan model=dsv32 pipeline=pp8 mode=serve serve.weights=fp8   # per stage: weights, KV tokens that fit
  dsaflow plan model=small index.freq=4 index.offset=1 pipeline.boundaries=[0,5]
  dsaflow plan --cfg job model=small            # the composed config, as Hydra prints it""",
    "train": """examples:
  dsaflow train                                  # the embedded job: tiny model, retrieval (docs/performance.md)
  dsaflow train pipeline=pp2 train.steps=600     # two pipeline ranks (gloo on CPU, NCCL on GPUs)
  dsaflow train model=small data=text data.path=README.md track=online
  dsaflow train -m index=all_full,every4 train.steps=100          # a sweep: one run dir per job + summary
  dsaflow train -m train.lr=1e-3,3e-3 train.seed='range(0,3)'    # 6 jobs, one after another
  dsaflow train train.resume=true run_dir=runs/<name>  # the run's own settings; add only what changes""",
    "generate": """serve.checkpoint=RUN serves RUN's model and layout (from its config.yaml).

examples:
  dsaflow generate serve.checkpoint=runs/<name> serve.max_new_tokens=1 serve.prompts='["qmzj xwv K7; pllr ?K"]'
  dsaflow generate serve.checkpoint=runs/<name> serve.prompts_file=prompts.jsonl pipeline=pp2
      # prompts.jsonl: one JSON object per line, {"prompt": "qmzj xwv K7; pllr ?K", "answer": "7"} ("answer":
      # optional; generate marks each completion against it and counts the right ones)
  dsaflow generate graphs=decode_prefill serve.checkpoint=runs/<name> serve.prompts_file=prompts.jsonl  # CUDA graphs""",
    "serve": """serve.checkpoint=RUN serves RUN's model and layout; server.* says how (docs/serving.md, "Online serving").

examples:
  dsaflow serve serve.checkpoint=runs/<name>                       # http://127.0.0.1:8000/v1, Ctrl-C drains and stops
  dsaflow serve serve.checkpoint=runs/<name> pipeline=pp2 parallel.dp=2 server.port=9000
  DSAFLOW_API_KEY=secret dsaflow serve model=hf model.hf_path=DIR server.host=0.0.0.0""",
    "search": """search.checkpoint is an index=all_full run; the stage split comes from pipeline.* (each stage's
first layer stays F); out_dir defaults to RUN_DIR/search.

examples:
  dsaflow search search.checkpoint=runs/<all-F run> search.ratio=0.25
  dsaflow search search.checkpoint=runs/<all-F run> search.target_f=3 pipeline=pp2
  (then: dsaflow train layout="<printed layout>" ...; see docs/search.md)""",
    "export": """export.checkpoint is a run dir (its newest good checkpoint) or one of its checkpoint folders; export.out_dir
a new folder. A model with dense MLPs only has no Hugging Face family and is refused.

examples:
  dsaflow export export.checkpoint=runs/<name> export.out_dir=hf/<name>
  (then: AutoModelForCausalLM.from_pretrained("hf/<name>"), or dsaflow generate model=hf model.hf_path=hf/<name>)""",
}
HYDRA_FLAGS = """Hydra flags (the parent process is a Hydra app; workers never import Hydra):
  -m, --multirun        run one job per combination of the sweeps (a=1,2  b='range(0,3)'  hydra/sweeper=...)
  --cfg job|hydra|all   print the composed config and exit (with --resolve: interpolations resolved)
  --info [TOPIC]        Hydra's information (config search path, defaults tree, plugins)
  --hydra-help          Hydra's own help
  -sc install=bash      print a bash completion script for `dsaflow` (use: eval "$(dsaflow -sc install=bash)")"""


def _groups_help() -> str:
    """Override help listing the options that actually exist in the config dir (so it never goes stale)."""
    from dsaflow.config.compose import default_config_dir

    cdir = default_config_dir()
    groups = sorted(p for p in cdir.iterdir() if p.is_dir()) if cdir.is_dir() else []
    lines = ["overrides (Hydra syntax: key=value, group=option, +key=value); groups and options:"]
    for g in groups:
        lines.append(f"  {g.name}={'|'.join(sorted(p.stem for p in g.glob('*.yaml')))}")
    lines.append('  layout="(FSSS)*2|(FSSS)*2" model.num_layers=16    (16 layers on two stages; docs/planning.md)')
    lines.append("  index.freq=4 index.offset=0  pipeline.boundaries=[0,4]  pipeline.stages=4")
    lines.append("  mode=train|serve  estimate_context=131072  run_dir=DIR (or hydra.run.dir=DIR)")
    lines.append("see docs/planning.md (layouts, plan JSON), docs/training.md (runs, sweeps), docs/search.md.")
    return "\n".join(lines)


# The config section each command reads besides the model, index and pipeline groups (listed in its help).
COMMAND_SECTIONS = {"plan": "plan", "generate": "serve", "serve": "server", "search": "search"}


def _type_text(tp) -> str:
    """A schema annotation in words: Optional[int] -> 'int or null', List[str] -> 'list of str', a Choice -> a|b."""
    import enum
    import typing

    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_text(a) for a in args) + " or null"
    if typing.get_origin(tp) in (list, typing.List):
        return "list of " + _type_text(args[0]) if args else "list"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "|".join(m.value for m in tp)
    return getattr(tp, "__name__", str(tp))


def section_fields_help(section: str) -> str:
    """Every field of one config section, read from the schema (so the help cannot drift): name, default, type
    and allowed range."""
    import dataclasses
    import typing

    from dsaflow.config.schema import DSAFlowConfig

    owner = typing.get_type_hints(DSAFlowConfig)[section]
    hints = typing.get_type_hints(owner)
    where = owner.__module__.replace(".", "/") + ".py"
    lines = [f"{section} fields ({section}.NAME=VALUE; {where} {owner.__name__}):"]
    for f in dataclasses.fields(owner):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = "null" if default is None else str(default).replace(" ", "") if isinstance(default, list) else default
        kind = _type_text(hints[f.name])
        rng = f.metadata.get("range")
        if rng:
            lo, hi, lo_open, hi_open = rng[:4]
            kind += f" in {'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}" + (
                ")" if hi_open else "]"
            )
        lines.append(f"  {section}.{f.name}={shown}".ljust(34) + f"  {kind}")
    return "\n".join(lines)


def usage_epilog(command: str = "plan") -> str:
    section = COMMAND_SECTIONS.get(command)
    fields = section_fields_help(section) + "\n\n" if section else ""
    return _groups_help() + "\n\n" + fields + HYDRA_FLAGS + "\n\n" + EXAMPLES[command] + "\n"


def _own_options(command: str) -> str:
    if command == "plan":
        return "[--format table|json] "
    if command in ("train", "generate", "serve"):
        return "[--nproc N] "
    return ""


def command_help(command: str) -> str:
    return (
        f"usage: dsaflow {command} [-h] {_own_options(command)}{'' if command == 'serve' else '[-m] '}"
        "[--cfg job|hydra|all [--resolve]] [--info] "
        f"[OVERRIDE ...]\n\n{COMMANDS[command]}\n\noptions:\n  -h, --help            show this help and exit\n"
        + (
            "  --format table|json   table (default) or only the plan JSON on stdout (also: format=json)\n"
            if command == "plan"
            else ""
        )
        + (
            "  --nproc N             processes to launch; must equal pipeline ranks x parallel.dp x parallel.cp (nproc=N)\n"
            if command in ("train", "generate", "serve")
            else ""
        )
        + "\n"
        + usage_epilog(command)
    )


def top_help() -> str:
    from dsaflow import __version__

    cmds = "\n".join(f"  {k:<10} {v}" for k, v in COMMANDS.items())
    return (
        f"usage: dsaflow [-h] [--version] {{{','.join(COMMANDS)}}} ...\n\n"
        f"dsaflow {__version__}: plan, train and serve DSA transformers with IndexCache across pipeline stages.\n\n"
        f"commands:\n{cmds}\n\n`dsaflow COMMAND --help` lists that command's options and examples.\n\n"
        + EXAMPLES["train"]
        + "\n"
    )


def run_cli_errors(fn, *args) -> int:
    """Run fn; a PlanError (config or plan mistake) becomes its message on stderr and exit status 2."""
    try:
        return fn(*args) or 0
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def split_options(command: str, rest: List[str]) -> Tuple[List[str], Optional[int], str]:
    """Pull the command's own options out of argv: --format (plan), --nproc (train, generate), and their Hydra-style
    spellings format=... / nproc=... (they belong to the command, not to the model config)."""
    out, nproc, fmt = [], None, "table"
    i = 0
    while i < len(rest):
        a = rest[i]
        key, eq, val = a.partition("=")
        if key in ("--format", "--nproc") and not eq:
            if i + 1 >= len(rest):
                raise PlanError(f"{key} needs a value. Fix: e.g. {key} {'json' if key == '--format' else '2'}.")
            val, eq = rest[i + 1], "="
            i += 1
        if key in ("--format", "format") and eq:
            if command != "plan":
                raise PlanError(f"{a}: only `dsaflow plan` has an output format. Fix: drop it.")
            if val not in ("table", "json"):
                raise PlanError(f"format={val!r} is not an output format. Fix: use --format table or --format json.")
            fmt = val
        elif key in ("--nproc", "nproc") and eq:
            if command not in ("train", "generate", "serve"):
                raise PlanError(f"{a}: only train, generate and serve launch processes. Fix: drop it.")
            try:
                nproc = int(val)
            except ValueError:
                raise PlanError(f"nproc={val!r} is not a number. Fix: e.g. --nproc 2.") from None
        else:
            out.append(a)
        i += 1
    return out, nproc, fmt


def _compose_and_plan(overrides: List[str], nproc: Optional[int] = None, command: str = "plan"):
    from dsaflow.app import single_run_dir, split_hydra_overrides
    from dsaflow.config.compose import compose, refuse_sweeps
    from dsaflow.plan import build_plan

    overrides, hyd = split_hydra_overrides(overrides)
    run_dir = single_run_dir(hyd, overrides)
    refuse_sweeps(overrides)
    if command in ("generate", "serve") and not any(o.lstrip("+").startswith("mode=") for o in overrides):
        overrides = ["mode=serve"] + overrides  # generating is serving: decode/prefill graph blocks are allowed
    from dsaflow.checkpoint.hf_config import apply_hf_model

    cfg = compose(overrides, model_source=apply_hf_model)
    if run_dir is not None:
        cfg.run_dir = run_dir
    from dsaflow.checkpoint.indexer_weights import plan_for_checkpoint
    from dsaflow.config.from_run import settings_from_run

    reads = "generate" if command == "serve" else command  # serve reads serve.checkpoint as generate does
    cfg = settings_from_run(cfg, overrides, reads)  # resume, serve, search: the run's own settings

    return cfg, plan_for_checkpoint(cfg, reads, lambda c: build_plan(c, nproc=nproc))


def cmd_single(command: str, overrides: List[str], nproc: Optional[int], fmt: str) -> int:
    from dsaflow.app import run_command

    cfg, plan = _compose_and_plan(overrides, nproc, command)
    return run_command(command, cfg, plan, fmt)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    from dsaflow.launch.interrupts import name_of, status_of, stop_signals_raise

    try:
        with stop_signals_raise():  # SIGINT/SIGTERM/SIGHUP at any moment: one line, 128 + signal
            code = _main(args)
        if argv is None:
            sys.stdout.flush()
    except KeyboardInterrupt as exc:  # the launcher and sweeps say more where they catch it first
        print(f"dsaflow: interrupted ({name_of(exc)})", file=sys.stderr, flush=True)
        code = status_of(exc)
    except BrokenPipeError:
        # The reader went away (`dsaflow train --info | head`): stop quietly. Point stdout at /dev/null so that the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    if argv is None:
        sys.exit(code)
    return code


SHELL_COMPLETION_FLAGS = ("-sc", "--shell-completion")


def shell_completion(args: List[str]) -> int:
    """`dsaflow -sc install=bash | uninstall=bash | query=bash`. The script Hydra installs runs `dsaflow -sc
    query=bash` with the line being typed in $COMP_LINE: complete the command name, then hand Hydra the overrides
    after it (Hydra completes config groups, options and keys)."""
    from dsaflow.app import run_hydra_app

    rest = [a for a in args if a not in SHELL_COMPLETION_FLAGS]
    action = rest[0].split("=", 1)[0] if len(rest) == 1 else ""
    if action not in ("install", "uninstall", "query"):
        raise PlanError(
            f"-sc {' '.join(rest) or '(nothing)'}: shell completion takes one of install=bash, "
            'uninstall=bash or query=bash. Fix: eval "$(dsaflow -sc install=bash)" in bash.'
        )
    if action == "install" and os.path.basename(sys.argv[0]) != "dsaflow":
        raise PlanError(
            f"-sc {rest[0]}: the completion is for the `dsaflow` command, and this is "
            f"{os.path.basename(sys.argv[0])} (python -m dsaflow.cli has no name a shell can complete). "
            "Fix: run it as `dsaflow -sc install=bash` (.venv/bin/dsaflow after scripts/setup.sh)."
        )
    if action != "query":
        return run_hydra_app("plan", ["-sc", rest[0]], None, "table")
    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if len(words) < 2 or (len(words) == 2 and not line.endswith(" ")):  # the command name itself
        typed = words[1] if len(words) == 2 else ""
        print(" ".join(c for c in COMMANDS if c.startswith(typed)))
        return 0
    if words[1] not in COMMANDS:
        return 0
    os.environ["COMP_LINE"] = words[0] + " " + line.split(words[1], 1)[1].lstrip()
    return run_hydra_app(words[1], ["-sc", rest[0]], None, "table")


def _main(args: List[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(top_help())
        return 0 if args else EXIT_USER_ERROR
    if args[0] in ("--version", "-V"):
        from dsaflow import __version__

        print(f"dsaflow {__version__}")
        return 0
    if any(a in SHELL_COMPLETION_FLAGS for a in args):
        return run_cli_errors(shell_completion, args[1:] if args[0] in COMMANDS else args)
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        near = [c for c in COMMANDS if c.startswith(command[:2])]
        print(
            f"dsaflow: error: {command!r} is not a command. Fix: use one of {', '.join(COMMANDS)}"
            + (f" (did you mean {near[0]}?)" if near else "")
            + "; `dsaflow --help` lists them.",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if command == "export":
        if "-h" in rest or "--help" in rest:
            sys.stdout.write(
                f"usage: dsaflow export export.checkpoint=RUN_DIR export.out_dir=OUT\n\n{EXAMPLES[command]}\n"
            )
            return 0
        from dsaflow.checkpoint.export_run import main as export_main

        return run_cli_errors(export_main, rest)
    if "-h" in rest or "--help" in rest:
        sys.stdout.write(command_help(command))
        return 0
    try:
        rest, nproc, fmt = split_options(command, rest)
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    from dsaflow.app import run_hydra_app, wants_hydra_app

    if command == "serve" and any(a in ("-m", "--multirun") for a in rest):
        print(
            "dsaflow: error: dsaflow serve -m: a sweep would start one server after another, each serving until it "
            "is stopped. Fix: drop -m and start one server per configuration.",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if wants_hydra_app(rest):
        return run_cli_errors(run_hydra_app, command, rest, nproc, fmt)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        print(
            f"dsaflow: error: unrecognized option {flags[0]!r}. Fix: see `dsaflow {command} --help` (overrides are "
            "key=value, without dashes).",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    return run_cli_errors(cmd_single, command, rest, nproc, fmt)


def build_parser() -> argparse.ArgumentParser:
    """An argparse view of the commands (for documentation tools; `main` parses argv itself)."""
    parser = argparse.ArgumentParser(prog="dsaflow", description=top_help().splitlines()[2])
    sub = parser.add_subparsers(dest="command")
    for name, text in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=usage_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("overrides", nargs="*", metavar="OVERRIDE")
    return parser


if __name__ == "__main__":
    main()
