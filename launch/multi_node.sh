#!/usr/bin/env bash
# Several nodes, one process per GPU, pipeline ranks spread over the nodes (rank = node_rank * nproc + local_rank).
# Every node runs this script; all of them read the SAME run dir on a shared filesystem (checkpoints go there too).
#
# 1. Once, anywhere with the repo (a login node is fine, no GPU needed):
#      RUN_DIR=$(python -m dsaflow.launch.launch prepare pipeline=pp8 model=small run_dir=/shared/runs/exp1)
# 2. On every node:
#      RUN_DIR=/shared/runs/exp1 NNODES=2 NODE_RANK=<0|1> NPROC_PER_NODE=4 \
#      MASTER_ADDR=<node 0 hostname> MASTER_PORT=29500 launch/multi_node.sh
# NNODES x NPROC_PER_NODE must equal the plan's pipeline ranks x parallel.dp (the worker checks and says so otherwise).
#
# Pipeline x data parallelism: global rank = dp index x pipeline ranks + pipeline rank, and a node's processes are
# consecutive global ranks, so with NPROC_PER_NODE a multiple of the pipeline ranks every node holds whole pipelines
# and only the once-per-step dp collectives cross nodes. E.g. two pp2 replicas on 2 nodes of 2 GPUs:
#      RUN_DIR=$(python -m dsaflow.launch.launch prepare pipeline=pp2 parallel.dp=2 model=small run_dir=/shared/runs/ppdp)
#      RUN_DIR=/shared/runs/ppdp NNODES=2 NODE_RANK=<0|1> NPROC_PER_NODE=2 MASTER_ADDR=<node 0> launch/multi_node.sh
# (on 2 nodes of 8 GPUs: pipeline=pp8 parallel.dp=2, NPROC_PER_NODE=8). A pipeline may also span whole nodes
# (pipeline ranks a multiple of NPROC_PER_NODE); a node size that cuts pipelines otherwise is refused (exit 2).
# Every wait (the rendezvous of the nodes, each collective or send/receive between ranks) gives up after the run's
# launch.timeout_s (set it when preparing, e.g. launch.timeout_s=120) with a message naming what it waited for.
# Rank 0 holds the run dir's lock while the job runs: a second launch on the same run dir is refused. Starting a
# finished (or started) run dir again is refused too; to continue it, prepare it again with train.resume=true
# (same run_dir, a larger train.steps if it finished), then start every node again.
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
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}  # a peer that left is reported once, in our words
TIMEOUT_S=$("$PYTHON" -m dsaflow.launch.timeouts "$RUN_DIR")

exec "$PYTHON" -m dsaflow.launch.agent \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="dsaflow-$(basename "$RUN_DIR")" \
  --rdzv-conf="join_timeout=$TIMEOUT_S,read_timeout=$TIMEOUT_S,close_timeout=$TIMEOUT_S" \
  -m dsaflow.worker "$RUN_DIR" --job "$JOB"
