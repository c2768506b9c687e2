#!/usr/bin/env bash
# GPU test and benchmark phases for a machine with one or more NVIDIA GPUs. Usage: bash scripts/gpu_run.sh PHASE
#   kernels: every gpu-marked op test, then scripts/bench_ops.py (kernel table with the torch and dense-SDPA baselines)
#            and scripts/bench_train.py layer (where a training step's time goes, 4K / 16K, the indexer loss in
#            the backward vs in the forward vs the reference; a 128K-token step of a 2-layer model with train.recompute=attention)
#   model:   the gpu-marked model, serving and training tests; the main job on one GPU; long-context training steps
#            with and without recomputation; the dense warm-up step at 16K
#   indexcache: scripts/bench_indexcache.py (IndexCache prefill / decode vs dense SDPA)
#   multi:   the gpu training tests, then the multigpu tests REPEAT times in a row (default 5)
#   serve:   pipelined serving on 2+ GPUs: scripts/bench_serve.py (graphs on, NCCL; --pipelines single,pp2, and pp4
#            with 4+ GPUs), then the NCCL greedy-identity tests (tests/test_serve_multigpu.py, the multigpu tests of
#            tests/test_graphs_gpu.py; pp4's with 4+ GPUs). The benchmark runs alone: a host busy with a test's
#            kernel compiles beside it builds its passes late and the GPUs wait (decode busy 0.80 instead of 0.95
#            on pp2). SERVE_STEPS="bench" or "tests" runs one part; PIPELINES replaces the pipelines; BENCH_ARGS adds
#            options (BENCH_ARGS="--max-batch 256 --trace": larger passes, one Chrome trace per rank and row)
#   fp8:     one H200: the FP8 GEMM and FP8 serving tests, the tile sweep (scripts/bench_fp8.py --sweep), then the
#            full-size DeepSeek-V3.2 pp8 stage (scripts/bench_serve.py stage: 8 MoE layers, 256 experts, FP8) and its
#            bf16 comparison on 2 layers
#   mixed:   mixed prefill/decode passes: their GPU tests (pp2 / pp4 cases with 2 / 4 GPUs), then bench_serve engine on
#            model=small with a sweep of serve.max_pass_tokens beside today's continuous and fixed batching, all
#            requests at the start and then arriving at RATES per second (default 120,170; --pipelines single)
#   replicas: 4 GPUs: two pp2 replicas (parallel.dp=2) against one pp2, greedy tokens and tokens/s
# Logs, JSON and markdown go to $OUT (default gpu_out/). Each step has its own time limit and keeps going after a
# failure; the last lines list every step's exit status.
set -uo pipefail
PHASE=${1:?usage: gpu_run.sh kernels|model|indexcache|serve|multi|fp8|mixed|replicas}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; LOG="$OUT/$PHASE.log"; : > "$LOG"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# a step's output goes to $STEP_LOG where set (steps that run side by side), else to the phase's log
step() { local name=$1 limit=$2; shift 2; echo "=== $name" | tee -a "$LOG"; local t0=$SECONDS
  timeout "$limit" "$@" >> "${STEP_LOG:-$LOG}" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s" | tee -a "$LOG"; }
summary() { grep -hE "passed|failed" "$LOG" | grep -E "^[0-9=]" | tail -n 8; }
case $PHASE in
kernels)
  step op_tests 260 python3 -m pytest -q -m gpu tests/test_ops_triton.py tests/test_ops_large.py \
    tests/test_ops_hopper.py tests/test_indexer_topk_kernels.py tests/test_indexer_fp8.py tests/test_ops_indexer_loss.py \
    tests/test_ops_dense_indexer_kl.py tests/test_ops_key_extent.py tests/test_ops_rope_rmsnorm.py \
    tests/test_ops_head_proj.py tests/test_ops_probs_into.py tests/test_ops_sparse_mla_probs.py
  summary
  step bench_ops 150 python3 scripts/bench_ops.py --out "$OUT" --only mla,decode --no-sweep
  step bench_topk 150 python3 scripts/bench_topk.py indexer --out "$OUT"
  step train_layer 240 python3 scripts/bench_train.py layer --seq 4096,16384 --layers 4 --out "$OUT"
  step train_128k 90 python3 scripts/bench_train.py layer --seq 131072 --layers 2 --index all_full --impls fused \
    --no-profile --reps 1 --recompute attention --out "$OUT/k128"
  cat "$OUT/bench_ops.md" "$OUT"/indexer_topk.md "$OUT/bench_train_layer.md" \
    "$OUT/k128/bench_train_layer.md" 2>/dev/null ;;
model)
  step model_tests 200 python3 -m pytest -q -m gpu tests/test_graphs_gpu.py tests/test_train_gpu.py \
    tests/test_generate_cli.py tests/test_dense_warmup.py tests/test_model_glue.py \
    tests/test_indexer_loss_in_backward.py
  summary
  step main_job_1gpu 120 python3 -m dsaflow.cli train train.device=cuda track=none train.progress=lines \
    run_dir=/tmp/r/main1
  cp /tmp/r/main1/metrics.jsonl "$OUT/main1_metrics.jsonl" 2>/dev/null
  step train_64k_2layers 100 python3 scripts/bench_train.py layer --seq 65536 --layers 2 --index all_full \
    --impls fused --no-profile --reps 1 --out "$OUT/k64"
  step train_64k_2layers_recompute 100 python3 scripts/bench_train.py layer --seq 65536 --layers 2 \
    --index all_full --impls fused --no-profile --reps 1 --recompute attention --out "$OUT/k64r"
  step train_128k_2layers_recompute 100 python3 scripts/bench_train.py layer --seq 131072 --layers 2 \
    --index all_full --impls fused --no-profile --reps 1 --recompute attention --out "$OUT/k128"
  step dense_warmup_16k 120 python3 scripts/bench_dense_warmup.py --out "$OUT/dense" --contexts 16384 \
    --layouts FS --op-layers 2 --budget-s 60
  step topk_128k 150 python3 scripts/bench_topk.py indexer --out "$OUT/topk" --contexts 131072 --prefill-context 0
  cat "$OUT"/k64/*.md "$OUT"/k64r/*.md "$OUT"/k128/*.md "$OUT"/dense/*.md "$OUT"/topk/*.md 2>/dev/null ;;
indexcache)
  step indexcache 540 python3 scripts/bench_indexcache.py --out "$OUT/indexcache" --decode-steps 32 --sdpa-repeats 2
  cat "$OUT"/indexcache/*.md 2>/dev/null ;;
multi)
  step train_gpu_tests 150 python3 -m pytest -q -m gpu tests/test_train_gpu.py
  summary | tail -n 1
  for i in $(seq 1 "${REPEAT:-5}"); do
    # 300 s: on a fresh machine the four tests compile every kernel first (150 s cut the last one at its final step)
    step multigpu_run$i 300 python3 -m pytest -q -m multigpu tests/
    summary | tail -n 1
  done ;;
serve)
  n_gpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  [ "$n_gpu" -ge 2 ] || { echo "the serve phase needs 2+ GPUs, this machine has $n_gpu"; exit 2; }
  [ "$n_gpu" -ge 4 ] && pipelines=single,pp2,pp4 || pipelines=single,pp2
  if [[ " ${SERVE_STEPS:-bench tests} " == *" bench "* ]]; then
    STEP_LOG="$OUT/bench.log" step bench_serve "${BENCH_LIMIT:-480}" python3 scripts/bench_serve.py engine --device cuda \
      --pipelines "${PIPELINES:-$pipelines}" --workloads uniform,mixed --requests "${REQUESTS:-512}" --out "$OUT/bench" \
      ${BENCH_ARGS:-}
  fi
  if [[ " ${SERVE_STEPS:-bench tests} " == *" tests "* ]]; then
    # pp2's tests on GPUs 0,1 (pp4's cases skip there), then pp4's on all four
    CUDA_VISIBLE_DEVICES=0,1 STEP_LOG="$OUT/tests_pp2.log" step serve_tests_pp2 "${TEST_LIMIT:-420}" python3 -m pytest \
      -q -m multigpu tests/test_serve_multigpu.py tests/test_graphs_gpu.py
    [ "$n_gpu" -ge 4 ] && STEP_LOG="$OUT/tests_pp4.log" step serve_tests_pp4 "${TEST_LIMIT:-420}" python3 -m pytest \
      -q -m multigpu tests/test_serve_multigpu.py -k pp4
    tail -qn 1 "$OUT"/tests_*.log
  fi
  cat "$OUT/bench/bench_serve.md" 2>/dev/null ;;
fp8)
  step fp8_tests 240 python3 -m pytest -q -m gpu tests/test_fp8_gemm_gpu.py tests/test_fp8_serve_gpu.py
  summary
  step sweep_fp8 200 python3 scripts/bench_fp8.py --device cuda --sweep --out "$OUT/sweep"
  step bench_fp8 150 python3 scripts/bench_fp8.py --device cuda --out "$OUT/fp8"
  step stage_fp8 300 python3 scripts/bench_serve.py stage --out "$OUT/stage"
  step stage_bf16 150 python3 scripts/bench_serve.py stage --weights bf16 --layers 2 --out "$OUT/stage_bf16"
  cat "$OUT"/sweep/*.md "$OUT"/fp8/*.md "$OUT"/stage/*.md "$OUT"/stage_bf16/*.md 2>/dev/null ;;
mixed)
  step mixed_tests 300 python3 -m pytest -q -m "gpu or multigpu" tests/test_serve_mixed_gpu.py \
    tests/test_serve_mixed_graphs_gpu.py
  summary
  # mixed passes from graphs: eager ones of model=small serve a tenth of the tokens/s (docs/performance.md)
  STEP_LOG="$OUT/bench.log" step bench_mixed "${BENCH_LIMIT:-480}" python3 scripts/bench_serve.py engine --device cuda \
    --pipelines "${PIPELINES:-single}" --workloads mixed,uniform --model small --max-pass-tokens "${BUDGETS:-1024,2048,4096}" \
    --mixed-graphs on --out "$OUT/bench_mixed" ${BENCH_ARGS:-}
  for rate in $(echo "${RATES:-120,170}" | tr , ' '); do
    STEP_LOG="$OUT/bench.log" step bench_mixed_arrivals_$rate 240 python3 scripts/bench_serve.py engine --device cuda \
      --pipelines single --workloads mixed --model small --max-pass-tokens "${BUDGETS:-1024,2048,4096}" \
      --mixed-graphs on --arrival-rate "$rate" --out "$OUT/bench_mixed_$rate"
  done
  cat "$OUT/bench_mixed/bench_serve.md" "$OUT"/bench_mixed_*/bench_serve.md 2>/dev/null ;;
replicas)
  step replica_tests 240 python3 -m pytest -q -m multigpu tests/test_serve_multigpu.py -k replicas
  summary
  STEP_LOG="$OUT/bench.log" step bench_replicas 300 python3 scripts/bench_serve.py engine --device cuda \
    --pipelines pp2,pp2x2 --workloads uniform --requests "${REQUESTS:-512}" --out "$OUT/bench_replicas"
  cat "$OUT/bench_replicas/bench_serve.md" 2>/dev/null ;;
*) echo "unknown phase $PHASE (kernels|model|indexcache|serve|multi|fp8|mixed|replicas)"; exit 2 ;;
esac
grep -E "^=== .* rc=" "$LOG"
