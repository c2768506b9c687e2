#!/usr/bin/env bash
# Sets up ./.venv with dsaflow (editable) and its dependencies; idempotent, quiet when already done.
# Machines without an NVIDIA GPU get the CPU build of torch (torch==2.13.0 resolves to a local CPU wheel on our
# machines; elsewhere set TORCH_SPEC and PIP_EXTRA_INDEX_URL, e.g. https://download.pytorch.org/whl/cpu).
# A machine whose python3 already has torch (the GPU image) reuses it through --system-site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
pip_q() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_q "${TORCH_SPEC:-torch}"
  else
    pip_q "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
.venv/bin/python -c "import torch" || { echo "setup: torch did not install (see above)" >&2; exit 1; }
if ! .venv/bin/python -c "import dsaflow, hydra, omegaconf, wandb, rich, safetensors, pytest, hypothesis, matplotlib, ruff, transformers, tokenizers, aiohttp, prometheus_client, jinja2, openai" 2>/dev/null; then
  pip_q -e ".[dev]"
fi
# Triton before 3.7 runs its CPU interpreter (the CPU tests' kernel runner) with numpy conversions that numpy 2.4
# refuses (triton-lang/triton#9171); such a triton gets a numpy it works with.
if .venv/bin/python -c "import numpy, triton, sys; v = lambda m: tuple(int(p) for p in m.__version__.split('.')[:2]); sys.exit(not (v(triton) < (3, 7) and v(numpy) >= (2, 4)))" 2>/dev/null; then
  echo "setup: triton < 3.7 with numpy >= 2.4 (triton-lang/triton#9171): installing numpy<2.4"
  pip_q "numpy<2.4"
fi
.venv/bin/python -c "import dsaflow, torch; print(f'setup: dsaflow ready (torch {torch.__version__}, cuda={torch.cuda.is_available()})')"
