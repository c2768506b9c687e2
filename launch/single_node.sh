#!/usr/bin/env bash
# Single node: one process per pipeline rank (NCCL on GPUs, gloo on CPU).
#
#   launch/single_node.sh [hydra overrides...]        plan, write a new run dir and train (= `dsaflow train ...`)
#   launch/single_node.sh --run-dir RUN_DIR [--job train|generate]
#                                                     torchrun on an existing run dir (its config.yaml + plan.json);
#                                                     e.g. after `python -m dsaflow.launch.launch prepare ...`
# Examples:
#   launch/single_node.sh pipeline=pp2 train.steps=500
#   launch/single_node.sh --run-dir runs/20260101-120000-tiny-retrieval
set -euo pipefail
PYTHON=${PYTHON:-python}
# Kept on the H200 machines (NVLink multicast off); your own values win.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

if [[ "${1:-}" != "--run-dir" ]]; then
  exec "$PYTHON" -m dsaflow.cli train "$@"
fi
RUN_DIR=$2; shift 2
JOB=train
if [[ "${1:-}" == "--job" ]]; then JOB=$2; shift 2; fi
# One process per pipeline rank: read it from the plan, never guess.
NPROC=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['pipeline']['ranks'])" "$RUN_DIR/plan.json")
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
  -m dsaflow.worker "$RUN_DIR" --job "$JOB"
