#!/usr/bin/env bash
# Build-check-benchmark on a lent GPU machine, in stages, each writing under $OUT:
#   bash scripts/device_run.sh STAGE [STAGE ...]
# Stages: env, tests, tests-fp32, attention, attention-full, model, model-compiled, model-triton, profile,
# leaderboard.
# The machine has no package registry, so the package runs from the checkout (PYTHONPATH) on the
# image's torch/Triton. The tree travels without .git: pass the commit in, e.g.
#   CS336_GIT_COMMIT=$(git rev-parse --short=12 HEAD)   (computed here, written into the run command)
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/results"
R="$OUT/results"

run_stage() {
  case "$1" in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      ;;
    tests)
      # CS336_AUTOTUNE=0: one config per kernel, so the cold compile of the test matrix stays short.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_weighted_sum.py \
        tests/test_kernels_flash_attention.py tests/test_adapters_attention.py tests/test_attention_registry.py \
        2>&1 | tee "$OUT/tests_gpu.log" | tail -40
      ;;
    attention)
      python3 -m cs336_systems.bench attention --sweep train --provider triton,sdpa-flash,sdpa-cudnn \
        --rep-ms 50 --no-progress --results-dir "$R" 2>&1 | tail -30
      python3 -m cs336_systems.bench attention --sweep flash --seq 1024,4096,8192,16384,32768,65536 --d 64,128 \
        --dtype bf16 --provider naive,triton,sdpa-flash,sdpa-cudnn --rep-ms 50 --no-progress --results-dir "$R" \
        --plot "$R/attention_tflops.png" 2>&1 | tail -45
      ;;
    attention-full)
      python3 -m cs336_systems.bench attention --sweep flash --rep-ms 40 --no-progress --results-dir "$R" \
        --plot "$R/attention_flash_sweep.png" 2>&1 | tail -20
      python3 -m cs336_systems.bench attention --sweep handout --no-progress --results-dir "$R" 2>&1 | tail -20
      ;;
    tests-fp32)
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_flash_attention.py \
        -k "dtype2 or memory or strided or saves" 2>&1 | tee "$OUT/tests_gpu_fp32.log" | tail -8
      ;;
    model)
      # Eager: every size, fp32 and bf16, all three modes, ours beside the PyTorch-native baseline.
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype fp32,bf16 --compile off \
        --provider ours,baseline --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -60
      ;;
    model-compiled)
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype bf16 --compile on \
        --mode train-step --provider ours,baseline --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -15
      ;;
    model-triton)
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype bf16 --compile off,on \
        --attention triton --mode train-step --no-progress --results-dir "$R" 2>&1 | tail -20
      ;;
    leaderboard)
      python3 -m cs336_systems.bench leaderboard --preset tiny --context 256 --verify --param-dtype bf16 \
        --warmup-ms 50 --rep-ms 100 --no-progress --results-dir "$R" 2>&1 | tail -3
      python3 -m cs336_systems.bench leaderboard --preset xl --context 8192 --warmup-ms 1000 --rep-ms 3000 \
        --results-dir "$R" 2>&1 | tail -12
      python3 -m cs336_systems.bench leaderboard --warmup-ms 2000 --rep-ms 6000 --results-dir "$R" 2>&1 | tail -12
      ;;
    profile)
      python3 -m cs336_systems.bench model --preset xl --mode train-step --dtype bf16 --profile --memory \
        --warmup 3 --steps 5 --no-progress --results-dir "$R" 2>&1 | tail -40
      ;;
    *) echo "unknown stage $1"; return 2 ;;
  esac
}

for stage in "$@"; do
  echo "=== stage $stage ($(date +%T))"
  run_stage "$stage"
done
echo "=== done ($(date +%T))"
