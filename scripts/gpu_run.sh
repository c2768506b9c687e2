#!/usr/bin/env bash
# Multi-GPU runs on a device machine (2-8 H200s). Usage: bash scripts/gpu_run.sh train|serve
#   train: all gpu/multigpu tests, the main job on 2 and 4 GPUs, bench_train.py on 2 and 4 ranks
#   serve: bench_decode.py on 1/2/4 GPUs, and DeepSeek-V3.2 attention shapes over 8 virtual stages on 4 GPUs
#          (training with Interleaved1F1B and 1F1B, generation with per-device decode graphs)
# Results (JSON + markdown) and one log per phase go to $OUT (default gpu_out/).
set -uo pipefail
PHASE=${1:?usage: gpu_run.sh smoke|train|serve|issue7}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; LOG="$OUT/$PHASE.log"; : > "$LOG"
if [ -d .whl ]; then bash .whl/install-wheels.sh .whl >/dev/null || exit 1; export PYTHONPATH=/tmp/site:$PWD; fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
step() { local name=$1 limit=$2; shift 2; echo "=== $name" | tee -a "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1; local rc=$?; echo "=== $name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"; }
grab() { for f in "$@"; do [ -f "$f" ] && cp "$f" "$OUT/"; done; }
DSV32_ATTN="model=dsv32 model.vocab_size=256 model.inter_dim=2048 index=every4"  # V3.2 attention, small MLP/vocab
BENCH="model=small train.seq_len=2048 train.batch_size=32 pipeline.microbatches=8"
case $PHASE in
smoke)
  step gpu_tests 300 python3 -m pytest -q -m "gpu or multigpu" tests/
  tail -n 4 "$LOG"
  step train_1gpu 150 python3 -m dsaflow.cli train model=small train.steps=30 train.seq_len=512 train.batch_size=8 \
    train.log_every=10 train.device=cuda run_dir=/tmp/r/train1 track=none
  step generate_1gpu 150 python3 -m dsaflow.cli generate model=small graphs=decode run_dir=/tmp/r/gen1 \
    'serve.prompts=["hello world","the quick brown fox"]' serve.max_new_tokens=16
  grep -E "^step|captured|generated" "$LOG" ;;
train)
  step gpu_tests 240 python3 -m pytest -q -m "gpu or multigpu" tests/
  tail -n 4 "$LOG"
  step main_2gpu 120 python3 -m dsaflow.cli train pipeline=pp2 train.device=cuda run_dir=/tmp/r/main2
  step main_4gpu 120 python3 -m dsaflow.cli train pipeline=pp4 train.device=cuda run_dir=/tmp/r/main4 track=none
  grep -h "eval_acc" "$LOG" | tail -n 4
  for r in 2 4; do [ "$NGPU" -ge $r ] || continue
    step bench_train_r$r 200 python3 scripts/bench_train.py --ranks $r --steps 10 --warmup 3 \
      --schedules GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble --out /tmp/bt$r $BENCH
    cp /tmp/bt$r/bench_train.json "$OUT/bench_train_r$r.json"; cp /tmp/bt$r/bench_train.md "$OUT/bench_train_r$r.md"
    cat "$OUT/bench_train_r$r.md"; done ;;
serve)
  step bench_decode 230 python3 scripts/bench_decode.py --gpus 1,2,4 --models small,mid --batches 1,8,64 \
    --steps 32 --repeats 2 --out /tmp/bd
  grab /tmp/bd/bench_decode.json /tmp/bd/bench_decode.md; cat /tmp/bd/bench_decode.md 2>/dev/null
  step dsv32_train_8v 130 python3 -m dsaflow.cli train $DSV32_ATTN model.num_layers=16 pipeline=pp4_interleaved \
    train.seq_len=4096 train.batch_size=8 train.steps=6 train.log_every=1 train.device=cuda \
    train.eval_every=0 train.final_ckpt=false track=none run_dir=/tmp/r/dsv32_8v
  step dsv32_generate_8v 100 python3 -m dsaflow.cli generate $DSV32_ATTN model.num_layers=16 \
    pipeline=pp4_interleaved graphs=decode serve.max_context=4096 'serve.prompts=["hello world","abc"]' \
    serve.max_new_tokens=32 run_dir=/tmp/r/dsv32_gen ;;
issue7)  # V3.2 attention shapes, 16 layers: 1F1B on 4 stages, Interleaved1F1B on 8 virtual stages, decode bench
  for pl in ${PIPELINES:-pp4 pp4_interleaved}; do  # 8 GPUs: PIPELINES=pp8
    step dsv32_train_$pl 110 python3 -m dsaflow.cli train $DSV32_ATTN model.num_layers=16 pipeline=$pl \
      train.seq_len=4096 train.batch_size=8 train.steps=5 train.log_every=1 train.lr=3e-4 train.device=cuda \
      train.eval_every=0 train.eval_batches=1 train.final_ckpt=false track=none run_dir=/tmp/r/dsv32_$pl
    cp /tmp/r/dsv32_$pl/metrics.jsonl "$OUT/dsv32_${pl}_metrics.jsonl"; done
  step dsv32_decode 110 python3 scripts/bench_decode.py --gpus 4 --models dsv32 --batches 1,8,32 --steps 16 \
    --repeats 2 --overrides "model.vocab_size=256 model.inter_dim=2048 model.num_layers=16 index=every4" --out /tmp/bd7
  grab /tmp/bd7/bench_decode.json /tmp/bd7/bench_decode.md; cat /tmp/bd7/bench_decode.md 2>/dev/null ;;
esac
grep -E "^=== .* rc=" "$LOG"
