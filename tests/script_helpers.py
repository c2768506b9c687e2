"""Import a script from scripts/ as a module, so its CPU smoke tests call `main(argv)` in-process. pytest puts
scripts/ on the path (pyproject.toml), as `python scripts/x.py` does, so `bench_lib` and `benches` resolve."""

import importlib


def load_script(name: str):
    """scripts/<name>.py (or a module under scripts/, e.g. "benches.serve_rank") as a module; its
    `if __name__ == "__main__"` block does not run."""
    return importlib.import_module(name)
