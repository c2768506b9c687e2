"""Load a script from scripts/ as a module, so its CPU smoke tests call `main(argv)` in-process."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    """scripts/<name>.py as a module (its `if __name__ == "__main__"` block does not run)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
