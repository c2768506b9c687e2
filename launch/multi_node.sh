#!/usr/bin/env bash
# Several nodes, one process per GPU, pipeline ranks spread over the nodes (rank = node_rank * nproc + local_rank).
# Every node runs this script; all of them read the SAME run dir on a shared filesystem (checkpoints go there too).
#
# 1. Once, anywhere with the repo (a login node is fine, no GPU needed):
#      RUN_DIR=$(python -m dsaflow.launch.launch prepare pipeline=pp8 model=small run_dir=/shared/runs/exp1)
# 2. On every node:
#      RUN_DIR=/shared/runs/exp1 NNODES=2 NODE_RANK=<0|1> NPROC_PER_NODE=4 \
#      MASTER_ADDR=<node 0 hostname> MASTER_PORT=29500 launch/multi_node.sh
# NNODES x NPROC_PER_NODE must equal the plan's pipeline ranks (the worker checks and says so otherwise).
# Resume after a failure: edit nothing, set train.resume=true when preparing (same run_dir), start again.
set -euo pipefail
PYTHON=${PYTHON:-python}
: "${RUN_DIR:?set RUN_DIR to the shared run dir written by 'python -m dsaflow.launch.launch prepare'}"
: "${NNODES:?set NNODES}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR to node 0}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
JOB=${JOB:-train}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="dsaflow-$(basename "$RUN_DIR")" \
  -m dsaflow.worker "$RUN_DIR" --job "$JOB"
