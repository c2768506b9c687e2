"""The shape of the house: imports flow one way between rooms and never in a circle between modules, the model
needs no plan or checkpoint, functions stay short enough to read whole and every module's basename is its own.

Rooms, bottom-up (a room may import rooms below it and itself, never one above or beside it):
    errors < config < data, track, ops < plan, model < rundir < checkpoint < pipeline < train, serve
    < launch, search < app, worker < cli
rundir: the run dir (config.yaml, plan.json, the lock); checkpoint: run checkpoints, the weights manifest, safetensors
I/O, the missing-indexer rules; pipeline: what train and serve share at run time (stage cutting, p2p, the executor).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsaflow

PKG = Path(dsaflow.__file__).parent
RANK = {
    "errors": 0,
    "config": 1,
    "data": 2,
    "track": 2,
    "ops": 2,
    "plan": 3,
    "model": 3,
    "rundir": 4,
    "checkpoint": 5,
    "pipeline": 6,
    "train": 7,
    "serve": 7,
    "launch": 8,
    "search": 8,
    "cli": 10,
    "app": 9,
    "worker": 9,
    "__init__": 0,
    "files": 0.5,
    "outputs": 0.6,
}


def room_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_rooms(path: Path) -> set:
    """dsaflow rooms this file imports, at any depth (function-level imports count too)."""
    tree = ast.parse(path.read_text())
    pkg_parts = list(path.relative_to(PKG).parent.parts)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    out.add(parts[0])
            elif node.module and node.module.split(".")[0] == "dsaflow" and "." in node.module:
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsaflow."):
                    out.add(a.name.split(".")[1])
    return out


def sources():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_room_has_a_rank():
    assert {room_of(p) for p in sources()} <= set(RANK), "a new room needs a place in RANK"


def test_no_upward_or_sideways_imports():
    bad = []
    for p in sources():
        here = room_of(p)
        for other in imported_rooms(p) - {here}:
            if RANK.get(other, 99) >= RANK[here]:
                bad.append(f"{p.relative_to(PKG)} ({here}) imports {other}")
    assert not bad, "\n".join(bad)


def imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_model_knows_nothing_of_plans_hydra_distributed_or_checkpoints():
    above = ("dsaflow.plan", "dsaflow.rundir", "dsaflow.checkpoint", "dsaflow.pipeline", "safetensors")
    for p in (PKG / "model").rglob("*.py"):
        for name in imported_modules(p):
            assert not name.startswith((*above, "hydra", "omegaconf", "torch.distributed")), (p, name)


MAX_FUNCTION_LINES = 80
# Kernel files: laid out by hand, one line per tile operation and launch arguments packed (pyproject's
# [tool.ruff.format] exclude); their launchers are read with the kernels they launch
KERNEL_FILES = ("triton_*.py", "hopper_*.py", "gluon_*.py")


def is_kernel(path: Path, fn: ast.FunctionDef) -> bool:
    """A Triton or Gluon kernel (decorated `triton.jit` / `gluon.jit`), or any function of an ops kernel file."""
    in_kernel_file = path.parent.parent == PKG / "ops" and any(path.match(p) for p in KERNEL_FILES)
    jit = any(ast.unparse(d).split("(")[0] in ("triton.jit", "gluon.jit") for d in fn.decorator_list)
    return in_kernel_file or jit


def test_functions_stay_short():
    """Every function and method under dsaflow/ spans at most MAX_FUNCTION_LINES lines, from its `def` line to its
    last line (its docstring and comments count: a function is read whole). Exempt: Triton and Gluon kernels
    (functions decorated `triton.jit` or `gluon.jit`) and every function of an ops kernel file (ops/*/triton_*.py,
    hopper_*.py, gluon_*.py), whose launchers set up grids and pass packed kernel arguments. A longer function is
    split into steps that each do one thing, not squeezed onto fewer lines."""
    long = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_kernel(p, node):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(PKG)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into steps):\n" + "\n".join(long)


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, modules: set) -> set:
    """The dsaflow modules `path` imports when it is imported: statements at module level (inside if / try too),
    not in functions and not under `if TYPE_CHECKING`. `from pkg import name` counts as importing pkg.name where
    that is a module, else pkg; the package __init__ a submodule import runs first is not counted (Python runs a
    package's __init__ before its submodules, so that edge is never a cycle of its own)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    full = f"{target}.{a.name}"
                    out.add(full if full in modules else target)

    visit(ast.parse(path.read_text()).body)
    return (out & modules) - {name}


def import_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module in `graph` (module -> modules it imports)."""
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def test_no_import_cycles_between_modules():
    """No dsaflow module imports (at module level) one that imports it back, directly or through others: a cycle
    works or fails by which module happens to be imported first. A function-level import is how a cycle is broken
    on purpose, and is not counted."""
    paths = {module_name(p): p for p in sources()}
    graph = {m: module_level_imports(p, set(paths)) for m, p in paths.items()}
    assert sum(map(len, graph.values())) > 100  # the walk sees the imports
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    cycles = import_cycles(graph)
    assert not cycles, "modules importing each other at module level:\n" + "\n".join(" <-> ".join(c) for c in cycles)


ERROR_NAMES = {
    "PlanError",
    "ConfigError",
    "ServeError",
    "CheckpointError",
    "ResourceError",
    "EXIT_USER_ERROR",
    "EXIT_INTERRUPTED",
}


def test_user_errors_and_exit_codes_are_defined_once_and_imported_from_dsaflow_errors():
    """dsaflow.errors is the one home of the user-error types and exit codes: nobody else defines them, and every
    import names dsaflow.errors (no re-exports through plan/, config/ or serve/)."""
    repo = PKG.parent
    files = sources() + sorted((repo / "tests").glob("*.py")) + sorted((repo / "scripts").glob("*.py"))
    bad = []
    for p in files:
        where = p.relative_to(repo)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names} & ERROR_NAMES
                module = node.module or ""
                if names and (node.level or module != "dsaflow.errors"):
                    bad.append(f"{where}: imports {sorted(names)} from {'.' * node.level}{module}")
            elif isinstance(node, (ast.ClassDef, ast.Assign)) and p != PKG / "errors.py":
                targets = (
                    [node.name]
                    if isinstance(node, ast.ClassDef)
                    else [t.id for t in node.targets if isinstance(t, ast.Name)]
                )
                bad += [f"{where}: defines {t}" for t in targets if t in ERROR_NAMES]
    assert not bad, "\n".join(bad)


def test_only_hydra_private_reaches_into_hydra_internals():
    """Hydra's private API is used in dsaflow/config/hydra_private.py only (pinned there; tests/test_hydra_private.py
    checks it against the installed Hydra)."""
    users = sorted(
        str(p.relative_to(PKG)) for p in sources() if any(m.startswith("hydra._internal") for m in imported_modules(p))
    )
    assert users == ["config/hydra_private.py"]


def test_dsaflow_plan_does_not_import_torch(tmp_path):
    """`dsaflow plan` composes and checks a config without torch or triton (importing torch costs more than the
    rest of the command): what it reads of a checkpoint it reads from file headers. A training plan and an FP8
    serving plan."""
    import subprocess
    import sys

    code = (
        "import sys; from dsaflow.cli import main; rc = main(['plan', 'model=tiny']); "
        "rc += main(['plan', 'model=dsv32', 'pipeline=pp8', 'mode=serve', 'serve.weights=fp8']); "
        "print('TORCH' if {'torch', 'triton'} & set(sys.modules) else 'NO-TORCH', rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH 0", r.stdout + r.stderr


def test_importing_the_ops_and_the_model_does_not_import_triton():
    """Importing an op (its dispatch table, its reference and its public entry point), or the model, leaves triton
    unimported: triton costs every process about 0.3 s and only a kernel launch needs it, so each kernel module is
    imported by the rule or call that uses it, on CUDA tensors. Checked in a fresh interpreter."""
    import subprocess
    import sys

    ops = sorted(p.name for p in (PKG / "ops").iterdir() if (p / "__init__.py").is_file())
    assert len(ops) >= 9
    code = (
        "import sys\n"
        + "".join(f"import dsaflow.ops.{op}\n" for op in ops)
        + "import dsaflow.model\n"
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["[]"], r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("data", ["data=retrieval", "data=text data.path=docs/serving.md"])
def test_the_launchers_checks_do_not_import_torch_without_a_gpu_driver(tmp_path, data):
    """`dsaflow train`'s parent checks the config, the data (its first batch, the corpus's vocabulary) and the
    machine's resources before torchrun starts; without a GPU driver none of that needs torch, which would cost
    every launch about 2 s on a small machine. With a driver, `train.device=auto` asks torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dsaflow.pipeline.devices as d\n"
        "d.gpu_driver_present = lambda: False\n"
        "from dsaflow.config.compose import compose\n"
        "from dsaflow.plan import build_plan\n"
        "from dsaflow.launch.launch import check_launch\n"
        f"cfg = compose(['model=tiny', *{data.split()!r}, 'track=none', 'run_dir={tmp_path / 'run'}'])\n"
        "check_launch(cfg, build_plan(cfg))\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', d.resolve_device_type('auto'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.stdout.strip().splitlines()[-1:] == ["NO-TORCH cpu"], r.stdout + r.stderr


def test_auto_device_asks_torch_when_a_gpu_driver_is_present(monkeypatch):
    import torch

    import dsaflow.pipeline.devices as devices

    monkeypatch.setattr(devices, "gpu_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.resolve_device_type("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device_type("auto") == "cpu"
    assert devices.resolve_device_type("cpu") == "cpu"


OPS_STANDARD_NAMES = {"naive.py", "dispatch.py", "function.py"}  # the one shape of an op folder (docs/kernels.md)


def test_no_two_modules_share_a_basename():
    """A file name says what the file is, so `grep`, tracebacks and editor tabs never leave a reader guessing which
    one is meant; only the standard files of an op folder repeat."""
    seen = {}
    for p in sources():
        rel = p.relative_to(PKG)
        if p.name == "__init__.py" or (rel.parts[0] == "ops" and p.name in OPS_STANDARD_NAMES):
            continue
        seen.setdefault(p.name, []).append(str(rel))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"modules sharing a basename (rename one to say what it is): {shared}"
