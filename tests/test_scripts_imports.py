"""scripts/ has no import cycle: every .py under scripts/ is parsed with `ast` (imports inside functions included, as
they run too), its imports of other scripts/ modules become edges, and the graph must be acyclic. The cycle finder is
itself checked on hand-made graphs, so a cycle in scripts/ cannot pass unseen."""

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def module_name(path: Path, root: Path = SCRIPTS) -> str:
    """scripts/bench_lib.py -> "bench_lib", scripts/benches/serve_rank.py -> "benches.serve_rank",
    scripts/benches/__init__.py -> "benches" (the names `python scripts/x.py` imports them by)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST) -> set:
    """Every module name an import statement anywhere in `tree` may load: `import a.b` -> a.b; `from a import b`
    -> a and a.b (b may be a module or a name in a)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def scripts_import_graph(root: Path = SCRIPTS) -> dict:
    """{module under root: the modules under root it imports}."""
    sources = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {
        name: sorted(n for n in imported_names(ast.parse(path.read_text())) if n in sources and n != name)
        for name, path in sources.items()
    }


def find_cycle(graph: dict) -> list | None:
    """A cycle of `graph` ({node: [nodes it points to]}) as [a, b, ..., a], or None when it is acyclic (depth-first
    search with the path on a stack: an edge back into the path closes a cycle)."""
    done, on_path, path = set(), set(), []

    def visit(node):
        path.append(node)
        on_path.add(node)
        for nxt in graph.get(node, ()):
            if nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for start in graph:
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None  # a diamond is no cycle
    assert find_cycle({"a": ["b"], "b": ["a"]}) == ["a", "b", "a"]
    assert find_cycle({"x": ["a"], "a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["a"]}) == ["a", "a"]


def test_imports_inside_functions_and_from_packages_are_edges():
    tree = ast.parse("def f():\n    from bench_fp8 import fp8_ceiling\nfrom benches import serve_setup\n")
    assert {"bench_fp8", "benches", "benches.serve_setup"} <= imported_names(tree)


def test_a_cycle_through_a_family_module_is_found(tmp_path):
    """An entry script that imports its family module in a function, and the module that imports the script back:
    the shape of cycle this test guards against."""
    (tmp_path / "benches").mkdir()
    (tmp_path / "benches" / "__init__.py").write_text("")
    (tmp_path / "bench_x.py").write_text("import bench_lib\n\ndef main():\n    from benches.x_sweep import run\n")
    (tmp_path / "benches" / "x_sweep.py").write_text("def run():\n    from bench_x import ceiling\n")
    (tmp_path / "bench_lib.py").write_text("")
    graph = scripts_import_graph(tmp_path)
    assert find_cycle(graph) == ["bench_x", "benches.x_sweep", "bench_x"]
    (tmp_path / "benches" / "x_sweep.py").write_text("def run():\n    from bench_lib import ceiling\n")
    assert find_cycle(scripts_import_graph(tmp_path)) is None


def test_the_graph_sees_the_scripts_modules():
    graph = scripts_import_graph()
    assert "bench_lib" in graph["bench_fp8"] and "bench_lib" in graph["benches.fp8_sweep"]
    assert "benches.serve_engine" in graph["benches.serve_rank"]


def test_scripts_have_no_import_cycle():
    assert find_cycle(scripts_import_graph()) is None


def test_every_bench_uses_the_one_harness():
    """Every `bench_*.py` entry script and every family subcommand module (a module with `main`) imports bench_lib
    (timing, ceilings, results, user errors)."""
    graph = scripts_import_graph()
    benches = [n for n in graph if n.startswith("bench_") and n != "bench_lib"]
    for path in sorted((SCRIPTS / "benches").glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            benches.append(module_name(path))
    assert len(benches) > 20
    assert [n for n in benches if "bench_lib" not in graph[n]] == []
