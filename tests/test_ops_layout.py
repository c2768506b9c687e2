"""Checks on the shape of the package and of dsaflow/ops, made statically with `ast`: no import circle anywhere in
dsaflow, every module under dsaflow/ops reachable from the public op entry points (so no module there serves only
tests or scripts), every op folder laid out the same way, and one dispatch table per op that has a choice."""

from __future__ import annotations

import ast
from pathlib import Path

import dsaflow

PKG = Path(dsaflow.__file__).parent
OPS = PKG / "ops"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path) -> set[str]:
    """dsaflow modules this file imports, at any depth (function-level and guarded imports count too): for `from M
    import x`, M.x where that is a module, else M."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            for alias in node.names:
                out.add(f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in MODULES else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_dsaflow():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def reachable(entries: list[str]) -> set[str]:
    """Modules that importing `entries` runs: their imports, transitively, and the packages above each."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]
        todo += GRAPH[mod]
    return seen


OP_FOLDERS = sorted(p for p in OPS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_every_ops_module_is_reached_from_a_public_op():
    """Starting from each op folder's `__init__` (what a user's call imports), every module under dsaflow/ops is
    imported: none is reached only from tests or scripts."""
    entries = [module_name(p / "__init__.py") for p in OP_FOLDERS]
    ops_modules = {m for m in MODULES if m == "dsaflow.ops" or m.startswith("dsaflow.ops.")}
    unreached = sorted(ops_modules - reachable(entries))
    assert not unreached, f"modules under dsaflow/ops that no public op imports: {unreached}"


def test_every_op_folder_has_a_reference_and_a_public_function():
    """Each op folder: naive.py (the fp32 reference) and an __init__ that defines or re-exports the public
    function(s) in __all__."""
    for folder in OP_FOLDERS:
        assert (folder / "naive.py").exists(), f"{folder.name}: no naive.py reference"
        tree = ast.parse((folder / "__init__.py").read_text())
        names = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
        ]
        assert names, f"{folder.name}/__init__.py has no __all__"


def test_no_op_warns_and_falls_back():
    """A CUDA shape the kernels refuse raises ValueError in every op folder: none warns and runs something else."""
    offenders = [str(p.relative_to(PKG)) for p in OPS.rglob("*.py") if "warnings.warn(" in p.read_text()]
    assert not offenders, offenders


def _functions(tree: ast.Module) -> list[str]:
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def _autograd_classes(tree: ast.Module) -> list[str]:
    return [
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in n.bases)
    ]


def test_every_op_folder_has_the_one_shape():
    """naive.py, dispatch.py with one public dispatch function `explain_*` (and a table, KERNELS), the kernels'
    autograd.Functions in function.py (a reference may differentiate itself in naive.py, as the chunked dense KL
    does), and public functions in __init__.py with docstrings, the op's entry point with Args and Returns."""
    for folder in OP_FOLDERS:
        files = {p.name: ast.parse(p.read_text()) for p in folder.glob("*.py")}
        assert {"naive.py", "dispatch.py", "__init__.py"} <= set(files), f"{folder.name}: {sorted(files)}"
        dispatch = files["dispatch.py"]
        explain = [name for name in _functions(dispatch) if name.startswith("explain_")]
        assert len(explain) == 1, f"{folder.name}/dispatch.py: dispatch functions {explain}"
        assert any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KERNELS" for t in n.targets)
            for n in dispatch.body
        ), f"{folder.name}/dispatch.py has no KERNELS table"
        for name, tree in files.items():
            if name not in ("function.py", "naive.py"):
                assert not _autograd_classes(tree), f"{folder.name}/{name} defines {_autograd_classes(tree)}"
        public = [n for n in files["__init__.py"].body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        docs = {fn.name: ast.get_docstring(fn) or "" for fn in public}
        assert all(docs.values()), f"{folder.name}/__init__.py: undocumented {[n for n, d in docs.items() if not d]}"
        documented = [name for name, doc in docs.items() if "Args:" in doc and "Returns:" in doc]
        assert documented, f"{folder.name}/__init__.py: no public function documented with Args and Returns"


def test_one_kernel_table_module_shared_by_every_dispatch():
    """Every dispatch walks its table with kernel_table.walk: no op keeps a second dispatch module."""
    for folder in OP_FOLDERS:
        extra = sorted(p.name for p in folder.glob("*dispatch*.py") if p.name != "dispatch.py")
        assert not extra, f"{folder.name}: {extra}"
        assert "walk(" in (folder / "dispatch.py").read_text(), folder.name
