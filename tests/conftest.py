"""Shared test setup: GPU markers skip cleanly on machines without CUDA devices."""

import os

import pytest
import torch

# Without a CUDA device, Triton kernels run in the CPU interpreter; this must be set before any @triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_numpy_conflict() -> str | None:
    """Triton before 3.7 runs `range()` over a kernel argument in its interpreter with `int()` of a one-element
    array, which numpy 2.4 refuses (triton-lang/triton#9171): every CPU kernel test would fail the same way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy
    import triton

    def major_minor(version: str) -> tuple[int, int]:
        return tuple(int(part) for part in version.split(".")[:2])

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton.__version__}'s CPU interpreter cannot run with numpy {numpy.__version__} "
            "(triton-lang/triton#9171). Fix: bash scripts/setup.sh (it installs numpy<2.4 beside such a triton), "
            "or pip install 'numpy<2.4', or triton>=3.7."
        )
    return None


def pytest_sessionstart(session):
    conflict = _interpreter_numpy_conflict()
    if conflict:
        pytest.exit(conflict, returncode=2)


# Under pytest-xdist (`-n N`), N workers share the machine's cores: give each its share of torch threads, so that two
# workers on two cores do not run four threads.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))
