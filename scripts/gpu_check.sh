#!/usr/bin/env bash
# GPU checks on a device machine (H100/H200 image: python3 with torch + triton; hydra/omegaconf/wandb carried as
# wheels in .whl/). Usage: bash scripts/gpu_check.sh [smoke|full]. Logs go to $OUT (or gpu_out/).
# smoke: every gpu/multigpu-marked test, a short `dsaflow train` and `dsaflow generate` with decode graphs.
set -uo pipefail
MODE=${1:-smoke}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then bash .whl/install-wheels.sh .whl >/dev/null || exit 1; export PYTHONPATH=/tmp/site:$PWD; fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"; }
step gpu_tests 300 python3 -m pytest -q -m "gpu or multigpu" tests/
step train_1gpu 150 python3 -m dsaflow.cli train model=small train.steps=30 train.seq_len=512 train.batch_size=8 \
  train.log_every=10 train.device=cuda run_dir=/tmp/runs/train1 track=none
step generate_1gpu 150 python3 -m dsaflow.cli generate model=small graphs=decode run_dir=/tmp/runs/gen1 \
  'serve.prompts=["hello world","the quick brown fox"]' serve.max_new_tokens=16
if [ "$MODE" = full ] && [ "$NGPU" -ge 2 ]; then
  step train_2gpu 200 python3 -m dsaflow.cli train model=small pipeline=pp2 train.steps=30 train.seq_len=512 \
    train.batch_size=8 train.device=cuda run_dir=/tmp/runs/train2 track=none
  step generate_2gpu 150 python3 -m dsaflow.cli generate model=small pipeline=pp2 graphs=decode \
    run_dir=/tmp/runs/gen2 'serve.prompts=["hello world"]' serve.max_new_tokens=16
fi
