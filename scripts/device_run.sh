#!/usr/bin/env bash
# Build-check-benchmark on a lent GPU machine, in stages, each writing under $OUT:
#   bash scripts/device_run.sh STAGE [STAGE ...]
# Stages: env, fp32-variants, session66, session65-micro, session65-min, session65-short, session65, session64, session64-short, session64-tune, session63, session62-short, session61, session60, session59-8b, session59, session58, session57, session56, session55, session54, session53-sizes, session53-short, session53, session52, session51, session50, session50-short, session50-min, session50-tests, session49, session48, session47, session46, session45, session44, session43, session42, session41, session40, session39, session38, session37, session36, session35, session34, session33, session30, session31, session29, session28, session27, session26, session25, session24, session22, session16, session18, session21, session12, session13, session14, session15, session5, session6, session7, session8, session9, session10, session11, tests, tests-session, tests-host, tests-fuzz, tests-all, tests-native-build, tests-launch-plan, attention-targets, fp32-error, fp32-precision, tests-gluon, one-pass-ws, attention-native, tests-layout, tests-fp32, tests-fused, tests-attention-fused, attention, attention-train, attention-full (= attention-flash +
# attention-handout), attention-host, attention-tune, model,
# model-compiled, model-triton, model-fused, model-sizes, model-sizes-compiled, model-sizes-profile, model-sizes-inductor, host-profile, tests-split, attention-d256, report-gpu, profile, memory, memory-profile, precision, cross-entropy, leaderboard,
# leaderboard-profile, leaderboard-quick, leaderboard-rope;
# on machines of several GPUs: multi-collectives, multi-parallel, leaderboard-2gpu.
# Result rows and PNGs go to a scratch folder that is packed into $OUT/results.tgz at the end (the
# device tool returns at most 8 files); unpack it into results/ here. Snapshots and traces stay behind.
# The machine has no package registry, so the package runs from the checkout (PYTHONPATH) on the
# image's torch/Triton. The tree travels without .git: pass the commit in, e.g.
#   CS336_GIT_COMMIT=$(git rev-parse --short=12 HEAD)   (computed here, written into the run command)
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent machines (KINDS.md: it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
OUT="${OUT:-/tmp/out}"
R=/tmp/cs336_results
mkdir -p "$OUT" "$R"

# pytest on the GPU, each result a line as it comes (-v: a run stopped at its time limit still names what failed),
# the log brought back whole as $OUT/tests_NAME.log; its failures, budget errors and summary printed.
#   gpu_tests NAME SECONDS PYTEST_ARGS...
gpu_tests() {
  local log="$OUT/tests_$1.log" limit=$2
  shift 2
  CS336_AUTOTUNE=0 timeout "$limit" python3 -m pytest -v -n 16 -rfE -p no:cacheprovider "$@" > "$log" 2>&1
  grep -E "^\[gw[0-9]+\] .*(FAILED|ERROR)" "$log" | head -20
  grep -E "^E .*(budget|Error)" "$log" | head -10
  tail -3 "$log"
}

# Liger-Kernel from a carried wheel (carry [".whl"]; the machine has no package registry), on PYTHONPATH where it
# was carried: pip download liger-kernel==0.8.5 --no-deps -d .whl
liger_on_path() {
  if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/liger .whl/liger_kernel-*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/liger"
  fi
}

# exp2's accuracy on this GPU and fuzz case 8's errors as ratios to their budgets (notes/flash_attention.md); the
# ratio script compiles its kernels cold, hence its 120 s (60 s did not suffice on the H200 in session21).
fp32_case8_checks() {
  timeout 30 python3 scripts/exp2_accuracy.py
  CS336_AUTOTUNE=0 timeout 120 python3 scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision default,ieee \
    --launcher python > "$OUT/fuzz_ratios_case8.txt" 2>&1; tail -10 "$OUT/fuzz_ratios_case8.txt"
}

# Every size (small..xl) at the given contexts and torch.compile settings, ours against the baseline, train step;
# EXTRA passes more model-suite options (e.g. --weight-copies on,off).
#   every_size SECONDS CONTEXTS COMPILES [EXTRA...]
every_size() {
  local limit=$1 contexts=$2 compiles=$3
  shift 3
  timeout "$limit" python3 -m cs336_systems.bench model --preset small,medium,large,xl --context "$contexts" \
    --dtype bf16 --compile "$compiles" --compile-scope block --provider ours,baseline --attention triton --fused \
    --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" "$@" 2>&1 | tail -40
}

# The whole step captured as CUDA graphs (--step-graph) beside the eager and compiled (per block) steps, ours against
# the baseline, train step, bf16; EXTRA passes more model-suite options (e.g. --rounds 2).
#   step_graph_sizes SECONDS PRESETS CONTEXTS COMPILES STEP_GRAPHS [EXTRA...]
step_graph_sizes() {
  local limit=$1 presets=$2 contexts=$3 compiles=$4 graphs=$5
  shift 5
  timeout "$limit" python3 -m cs336_systems.bench model --preset "$presets" --context "$contexts" --dtype bf16 \
    --compile "$compiles" --step-graph "$graphs" --compile-scope block --provider ours,baseline --attention triton \
    --fused --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" "$@" 2>&1 \
    | tail -30
}

# The 8B step at 32k beside the baseline (issue 35), warm-up 1000 ms and REP_MS (default 12000) of timing.
#   leaderboard_step SECONDS [REP_MS]
leaderboard_step() {
  timeout "$1" python3 -m cs336_systems.bench leaderboard --warmup-ms 1000 --rep-ms "${2:-12000}" --results-dir "$R" \
    2>&1 | tail -8
}

# The attention train sweep, ours against cuDNN (issue 35's attention targets).
attention_train_sweep() {
  timeout 90 python3 -m cs336_systems.bench attention --sweep train --provider triton,sdpa-cudnn --rep-ms 500 \
    --no-progress --results-dir "$R" 2>&1 | tail -10
}

# A fresh copy of the tree at /tmp/NAME, for a variant of it (a patch applied, files copied over).
#   scratch_tree NAME
scratch_tree() {
  rm -rf "/tmp/$1" && mkdir -p "/tmp/$1" && cp -r cs336_basics cs336_systems scripts tests "/tmp/$1"/
}

# Apply a patch (-p1) to the current directory: patch(1), or git apply where the image lacks it (it applies outside a
# repository too).   apply_patch PATCH_PATH
apply_patch() { if command -v patch >/dev/null; then patch -p1 -s < "$1"; else git apply -p1 "$1"; fi; }

run_stage() {
  case "$1" in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      ;;
    tests)
      # CS336_AUTOTUNE=0: one config per kernel, so the cold compile of the test matrix stays short.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_weighted_sum.py \
        tests/test_kernels_compensated_sum.py \
        tests/test_kernels_flash_attention.py tests/test_adapters_attention.py tests/test_attention_registry.py \
        tests/test_memory_checkpointing.py 2>&1 | tee "$OUT/tests_gpu.log" | tail -40
      ;;
    tests-session)
      # What the 2026-12-05 session changed without a GPU (stride tuples in every FlashAttention kernel and the
      # native packer, the in-place SwiGLU backward, the CE loss's weight-dtype mode) and what it never ran on one
      # (the operators' CUDA-graph replay, the fuzz test's three dtypes); the log comes back whole.
      CS336_AUTOTUNE=0 timeout 540 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_kernels_flash_attention.py tests/test_kernels_flash_launch_plan.py tests/test_adapters_attention.py \
        tests/test_attention_registry.py tests/test_operators.py tests/test_kernels_rmsnorm_swiglu.py \
        tests/test_kernels_cross_entropy.py tests/test_kernels_flash_fuzz.py tests/test_memory_checkpointing.py \
        tests/test_bench_fused_ops.py tests/test_bench_cross_entropy.py > "$OUT/tests_session.log" 2>&1
      tail -30 "$OUT/tests_session.log"
      ;;
    tests-host)
      # What the 2026-12-05 third session changed without a GPU: the Gluon backward kernels' nested stride tuples
      # (PTX identical on CPU, through Triton's own binder), launch plans for the small kernels (a replay must equal
      # the normal launch bit for bit), RoPE's positions check and the fused model's cached positions, the launch
      # buffers' module; the fourth session's fp32 row statistics pass (its native plans too). The log comes back
      # whole. The GPU fuzz (both FA2 classes, every dtype at 2x) is stage tests-fuzz.
      gpu_tests host "${TESTS_HOST_TIMEOUT:-420}" \
        tests/test_kernels_flash_attention.py tests/test_kernels_flash_launch_plan.py tests/test_operators.py \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_kernels_cross_entropy.py tests/test_adapters_attention.py \
        tests/test_recipe.py
      ;;
    tests-fuzz)
      # The numerical fuzz on the GPU: 200 shapes x fp32/bf16/fp16 x both FA2 classes, each within 2x PyTorch's own
      # error (the Triton kernels' fp32 through the row statistics pass since the fourth 2026-12-05 session; 3 min 40 s
      # with -n 16 at 4a2f69e3, CPU cases included).
      gpu_tests fuzz "${TESTS_FUZZ_TIMEOUT:-480}" tests/test_kernels_flash_fuzz.py -k "flash_fuzz_gpu"
      ;;
    session5)
      # The fifth 2026-12-05 session's GPU call (~6 min): (1) its tests: the merged Q/K/V product and RoPE's
      # dim-order output (tests/test_kernels_rmsnorm_swiglu.py), the host profile's test, the fuzz's ratio script,
      # and the Triton kernels' fp32 fuzz at 2x (one case, 8, failed in tests-fuzz; the run stopped at its limit with
      # 9 fp16 cases left, run here too); (2) case 8's ratios by precision and launcher; (3) where a small step's host
      # time goes with and without the merged product; (4) ours against the baseline at every size, eager, ctx 512.
      gpu_tests session5 210 \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_kernels_flash_fuzz.py \
        -k "(triton_flash_fuzz_gpu and (fp32 or fp16-162 or fp16-183 or fp16-186 or fp16-187 or fp16-188 or fp16-190 \
or fp16-194 or fp16-197 or fp16-199)) or ratios_script or step_host_profile or not fuzz"
      for launcher in python native; do
        timeout 60 python3 scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision default,ieee,tf32x3 \
          --launcher $launcher 2>&1 | tail -14
      done
      timeout 90 python3 scripts/step_host_profile.py --preset small --context 512 --compile off --steps 20 \
        --variants baseline,ours,ours-unmerged --out "$R/host_profile" 2>&1 | tail -5
      timeout 170 python3 -m cs336_systems.bench model --preset small,medium,large,xl --context 512 --dtype bf16 \
        --compile off --provider ours,baseline --attention triton --fused --optimizer fused --mode train-step \
        --warmup 3 --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -12
      ;;
    session6)
      # The sixth 2026-12-05 session's one call (6.7 min of device time were left, the machine's start included):
      # stage session5 cut to what matters most. (1) the merged Q/K/V product and RoPE's dim-order output on the GPU,
      # the operators, the host profile's test, the fuzz's fp32 case 8 (the one over 2x); (2) case 8's ratios;
      # (3) ours against the baseline at small and medium, eager, ctx 512, with the merged product.
      gpu_tests session6 120 \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_kernels_flash_fuzz.py \
        -k "(triton_flash_fuzz_gpu and fp32-8) or ratios_script or step_host_profile or not fuzz"
      timeout 30 python3 scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision default,ieee \
        --launcher python 2>&1 | tail -10
      timeout 75 python3 -m cs336_systems.bench model --preset small,medium --context 512 --dtype bf16 \
        --compile off --provider ours,baseline --attention triton --fused --optimizer fused --mode train-step \
        --warmup 3 --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -8
      ;;
    session7)
      # The seventh 2026-12-05 session's first call (~7 min): (1) the merged Q/K/V and w1/w3 products and the packed
      # gate on the GPU, the operators, the recipe, the host profile's test, the fuzz's fp32 case 8 (the one over
      # 2x) and the nine fp16 cases never run; (2) case 8's ratios; (3) a small step's host time, ours merged and
      # unmerged against the baseline; (4) ours against the baseline at every size, eager, ctx 512.
      gpu_tests session7 150 \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_recipe.py \
        tests/test_kernels_flash_fuzz.py \
        -k "(triton_flash_fuzz_gpu and (fp32-8 or fp16-162 or fp16-183 or fp16-186 or fp16-187 or fp16-188 \
or fp16-190 or fp16-194 or fp16-197 or fp16-199)) or ratios_script or step_host_profile or not fuzz"
      timeout 40 python3 scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision default,ieee \
        --launcher python 2>&1 | tail -10
      timeout 120 python3 scripts/step_host_profile.py --preset small --context 512 --compile off --steps 20 \
        --variants baseline,ours,ours-unmerged --out "$R/host_profile" 2>&1 | tail -5
      timeout 200 python3 -m cs336_systems.bench model --preset small,medium,large,xl --context 512 --dtype bf16 \
        --compile off --provider ours,baseline --attention triton --fused --optimizer fused --mode train-step \
        --warmup 3 --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -12
      ;;
    session8)
      # The next session's first call (~7 min; carry [".whl"] for Liger): (1) the operators on the GPU, with our
      # pointwise kernels as triton_ops under torch.compile (CS336_TRITON_OPS=1: inductor launches them; written
      # in the seventh 2026-12-05 session, never run on a GPU) and the usual custom ops; (2) a compiled small step's
      # host time, ours with each form against the baseline; (3) ours compiled with triton_ops at every size, the
      # baseline beside it; (4) the fuzz's fp32 case 8 ratios (40 s was too short for its compile); (5) the fused
      # CE against Liger in one run.
      gpu_tests session8 180 tests/test_operators.py tests/test_kernels_rmsnorm_swiglu.py
      timeout 150 python3 scripts/step_host_profile.py --preset small --context 512 --compile on --steps 10 \
        --variants ours,ours-custom-ops,baseline --out "$R/host_profile" 2>&1 | grep -v Warn | tail -5
      CS336_TRITON_OPS=1 timeout 200 python3 -m cs336_systems.bench model --preset small,medium,large,xl \
        --context 512 --dtype bf16 --compile on,reduce-overhead --compile-scope block --provider ours,baseline \
        --attention triton --fused --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress \
        --results-dir "$R" 2>&1 | tail -18
      timeout 120 python3 scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision default,ieee \
        --launcher python 2>&1 | tail -10
      run_stage cross-entropy
      ;;
    session12)
      # The ninth 2026-12-05 session's first call (~8 min): our attention's registered operators (what torch.compile's
      # graphs call) replay native C++ plans: their GPU tests, a compiled small step's host time with and without
      # them (ours-python-attention) beside the baseline, every size at ctx 512 compiled and as CUDA graphs, and one
      # compiled profile of small/512 per provider (kernel time per phase and kind of work).
      gpu_tests session12 200 tests/test_kernels_flash_launch_plan.py tests/test_operators.py \
        -k "native or operators or compile or cuda_graph or opcheck or one_product"
      timeout 150 python3 scripts/step_host_profile.py --preset small --context 512 --compile on --steps 10 \
        --variants ours,ours-python-attention,baseline --out "$R/host_profile" 2>&1 | grep -v Warn | tail -5
      every_size 200 512 on,reduce-overhead
      timeout 100 python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 --provider ours,baseline \
        --compile on --compile-scope block --attention triton --fused --optimizer fused --mode train-step --profile \
        --warmup 3 --steps 5 --no-progress --results-dir "$R" > "$OUT/profile_compiled.log" 2>&1
      grep -A3 "^| preset" "$OUT/profile_compiled.log" | head -8
      ;;
    session13)
      # The ninth session's H200 call (~9 min; needs the H200: the 8B step's peak is 133 GiB; carry [".whl"]): the
      # 8B step against the baseline from a cold cache, the attention targets, the fused CE and gate against Liger.
      run_stage leaderboard
      TARGET_RUNS=1 run_stage attention-targets
      liger_on_path
      timeout 90 python3 -m cs336_systems.bench cross-entropy --tokens 8192,32768 --provider fused,fused-lean,liger \
        --no-progress --results-dir "$R" 2>&1 | tail -5
      timeout 60 python3 -m cs336_systems.bench fused-ops --no-progress --results-dir "$R" 2>&1 | tail -8
      ;;
    fp32-variants)
      # Issue 33: the fp32 Triton fuzz's ours / budget over all 200 cases (mean, p95, max per tensor), per variant:
      # this tree; this tree without FMA contraction (TRITON_DEFAULT_FP_FUSION=0); each scripts/fp32_variants/*.patch
      # applied to a scratch copy of the tree (what each tries is at its top); each carried .probe/variant_NAME/ (files
      # copied over cs336_systems/kernels/flash_attention/). Each variant runs as 16 processes: about 4 min a variant
      # from a cold Triton cache on the H100 (the tree at ad9309b), so two fit in one call.
      fp32_variant() {  # NAME TREE [VAR=VALUE ...]
        local name=$1 tree=$2
        shift 2
        local pids=()
        for start in $(seq 0 13 199); do  # 16 processes, one per CPU core, 13 cases each
          local part="$start-$(( start + 12 < 199 ? start + 12 : 199 ))"
          (cd "$tree" && env "$@" PYTHONPATH="$tree" CS336_AUTOTUNE=0 timeout 270 python3 scripts/flash_fuzz_ratios.py \
            --cases "$part" --dtype fp32 > "$R/fp32_variants/${name}_${part}.txt" 2>&1) &
          pids+=($!)
        done
        wait "${pids[@]}"  # (a bare wait would wait for the packer below too, i.e. forever)
        echo "--- $name"
        python3 scripts/flash_fuzz_ratios.py --summarize "$R"/fp32_variants/"${name}"_*.txt
        grep -h "failed:" "$R"/fp32_variants/"${name}"_*.txt | head -5
      }
      mkdir -p "$R/fp32_variants"  # (16 files a variant: packed into results.tgz, not each brought back)
      # FP32_VARIANTS picks some by name (two fit in one call's 10 minutes), e.g. "tree two_chains".
      wanted() { [ -z "${FP32_VARIANTS:-}" ] || [[ " $FP32_VARIANTS " == *" $1 "* ]]; }
      wanted tree && fp32_variant tree "$PWD"
      wanted no-fusion && fp32_variant no-fusion "$PWD" TRITON_DEFAULT_FP_FUSION=0
      for patch_file in scripts/fp32_variants/*.patch; do
        name=$(basename "$patch_file" .patch)
        wanted "$name" || continue
        patch_path="$PWD/$patch_file"
        scratch_tree "$name"
        if (cd "/tmp/$name" && apply_patch "$patch_path"); then
          fp32_variant "$name" "/tmp/$name"
        else
          echo "--- $name: the patch does not apply to this tree"
        fi
      done
      for variant in .probe/variant_*/; do
        [ -d "$variant" ] || continue
        name=$(basename "$variant")
        wanted "${name#variant_}" || continue
        scratch_tree "$name"
        cp "$variant"/*.py "/tmp/$name"/cs336_systems/kernels/flash_attention/
        fp32_variant "${name#variant_}" "/tmp/$name"
      done
      ;;
    session30)
      # The fourteenth session's first call (~9 min), issue 33: the fp32 GPU fuzz of both FA2 classes with S summed
      # in fp64 (the judge), then the fp32 forward and backward time of the tree against the one fp32 chain it
      # replaced (scripts/fp32_variants/fp32_scores.patch), both autotuned, one process each on this machine.
      gpu_tests session30_fp32 150 tests/test_kernels_flash_fuzz.py -k "gpu and fp32"
      gpu_tests session30_adapters 90 tests/test_adapters_attention.py tests/test_kernels_flash_fp32_precision.py
      scratch_tree fp32_scores
      old_patch="$PWD/scripts/fp32_variants/fp32_scores.patch"
      (cd /tmp/fp32_scores && apply_patch "$old_patch") || echo "--- the patch does not apply"
      mkdir -p "$R/fp32_timing"
      for variant in tree fp32_scores; do
        tree=$PWD; [ "$variant" = tree ] || tree=/tmp/$variant
        echo "--- fp32 timing: $variant"
        (cd "$tree" && PYTHONPATH="$tree" CS336_GIT_COMMIT="${CS336_GIT_COMMIT:-unknown}-$variant" timeout 150 \
          python3 -m cs336_systems.bench attention --batch 1 --heads 1 --seq 2048,8192 --d 64,128 --dtype fp32 \
          --causal on --provider triton --pass fwd,bwd --no-progress --results-dir "$R/fp32_timing/$variant" 2>&1 \
          | tail -12)
      done
      ;;
    session31)
      # The fourteenth session's second call (~9 min): the FlashAttention tests in fp32 and the 16-bit GPU fuzz at
      # today's kernels (issue 33's counts), then the fp32 fuzz's ratios over all 200 cases (mean, p95, max).
      gpu_tests session31_flash 120 tests/test_kernels_flash_attention.py -k "float32 or fp32"
      gpu_tests session31_16bit 240 tests/test_kernels_flash_fuzz.py -k "gpu and (bf16 or fp16)"
      FP32_VARIANTS="tree" run_stage fp32-variants
      ;;
    session29)
      # The thirteenth session's closing check (~3 min): the weight copies' tests on the GPU, training included
      # (the kernel keeps the copies current, eagerly and as CUDA graphs), and the fused AdamW's.
      gpu_tests session29 150 tests/test_weight_copies.py tests/test_kernels_adamw.py
      ;;
    session28)
      # The thirteenth session's last call (~5 min): the weight copies at medium, large and xl as CUDA graphs, with
      # the weight gradients from the product in fp32 (mm with out_dtype) and as a bf16 product and a cast
      # (CS336_FP32_WEIGHT_GRADIENTS=0), each run with and without the copies and the baseline.
      for fp32_grads in 1 0; do
        CS336_FP32_WEIGHT_GRADIENTS=$fp32_grads timeout 170 python3 -m cs336_systems.bench model \
          --preset medium,large,xl --context 512 --dtype bf16 --compile reduce-overhead --compile-scope block \
          --provider ours,baseline --attention triton --fused --optimizer fused --weight-copies on,off \
          --mode train-step --warmup 3 --steps 10 --no-progress --results-dir "$R" 2>&1 | grep "^| [a-z]" | cut -c1-12,120-
      done
      ;;
    session27)
      # The thirteenth session's third call (~8 min): the weights' compute-dtype copies (cs336_systems/weight_copies.py)
      # on the GPU -- their tests, the fused AdamW's and the compiled model's -- then every size at ctx 512, eager,
      # compiled and as CUDA graphs, ours with and without the copies against the baseline, in one run.
      gpu_tests session27 120 tests/test_weight_copies.py tests/test_kernels_adamw.py tests/test_operators.py \
        -k "copies or adamw or compiles_with_the_kernels or cuda_graph or one_product"
      every_size 420 512 off,on,reduce-overhead --weight-copies on,off
      ;;
    session50-tests)
      # The step graph's first GPU check (~3 min): its and FusedAdamW's GPU tests, then small eager with and without it.
      gpu_tests session50 90 tests/test_step_graph.py tests/test_kernels_adamw.py
      step_graph_sizes 80 small 512 off on,off --warmup-s 0.5
      ;;
    session50-min)
      # The least of session50 (~4 min): the step graph's and FusedAdamW's GPU tests, then small alone.
      gpu_tests session50 80 tests/test_step_graph.py tests/test_kernels_adamw.py
      step_graph_sizes 150 small 512 off,on on,off --rounds 2
      ;;
    session50-short)
      # session50 in about six minutes, where little device time is left: the step graph's and FusedAdamW's GPU
      # tests, then small and medium only.
      gpu_tests session50 100 tests/test_step_graph.py tests/test_kernels_adamw.py
      step_graph_sizes 230 small,medium 512 off,on on,off --rounds 2
      ;;
    session50)
      # The whole step captured as CUDA graphs (~9 min, H100 or H200): its GPU tests (graphed train steps of both
      # providers against eager twins, FusedAdamW's capturable form) and the fused forms as subclasses (session49's);
      # then small, medium and large at ctx 512, eager and compiled per block, with and without the step graph, ours
      # against the baseline, 2 interleaved rounds.
      gpu_tests session50 120 tests/test_step_graph.py tests/test_kernels_adamw.py
      gpu_tests session49 100 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_weight_copies.py \
        -k "rope or rmsnorm or fused or opcheck_kernels or compiles_with_the_kernels or cuda_graph or copies"
      step_graph_sizes 320 small,medium,large 512 off,on on,off --rounds 2
      ;;
    session56)
      # The mid-block residual add fused into the second norm (~9 min, H100 or H200): its GPU tests (kernels, operators,
      # the compiled model, the step graph); then medium and large at ctx 512 and 2048, compiled with the step graph,
      # ours with the fused add and without it against the baseline, 2 interleaved rounds.
      gpu_tests session56 150 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_step_graph.py
      step_graph_sizes 360 medium,large 512,2048 on on --residual-norm on,off --rounds 2
      ;;
    session66)
      # Issue 32's sizes the optimizer weighs most (~9 min, H200 for the issue's card): large and xl at ctx 512, then
      # medium and large at 2048, compiled per block with the step graph, against the baseline; then the attention
      # train sweep with the host descriptors off beside session65's (on).
      step_graph_sizes 260 large,xl 512 on on
      step_graph_sizes 200 medium,large 2048 on on
      CS336_FLASH_HOST_DESCRIPTORS=0 attention_train_sweep
      ;;
    session65-micro)
      # The optimizer alone (about 2 min): its GPU tests, its step's bandwidth at large.
      gpu_tests session65 50 tests/test_kernels_adamw.py tests/test_weight_copies.py
      timeout 50 python3 scripts/adamw_bandwidth.py --preset large --blocks 2048x4 --rep-ms 200 --results-dir "$R" 2>&1 | tail -8
      ;;
    session65-min)
      # The least of session65 (under 4 min): the optimizer's GPU tests, its step's bandwidth at large and xl, the
      # attention train sweep against cuDNN.
      gpu_tests session65 60 tests/test_kernels_adamw.py tests/test_weight_copies.py
      timeout 70 python3 scripts/adamw_bandwidth.py --rep-ms 300 --results-dir "$R" 2>&1 | tail -16
      timeout 90 python3 -m cs336_systems.bench attention --sweep train --provider triton,sdpa-cudnn --rep-ms 300 \
        --no-progress --results-dir "$R" 2>&1 | tail -10
      ;;
    session65-short)
      # session65 within 6 min: the optimizer's GPU tests and the attention's on host descriptors, the optimizer step's
      # bandwidth, the train sweep.
      gpu_tests session65 140 tests/test_kernels_adamw.py tests/test_weight_copies.py tests/test_step_graph.py \
        tests/test_kernels_flash_attention.py -k "adamw or copies or graph or host_descriptors"
      timeout 80 python3 scripts/adamw_bandwidth.py --results-dir "$R" 2>&1 | tail -16
      timeout 120 python3 -m cs336_systems.bench attention --sweep train --provider triton,triton-two-pass-bwd,sdpa-cudnn \
        --rep-ms 400 --no-progress --results-dir "$R" 2>&1 | tail -14
      ;;
    session65)
      # Host descriptors as the default, and FusedAdamW's 16-byte form, first whole run (~7.5 min, H200 for the issue's
      # card, else H100): the attention, launch-plan and optimizer GPU tests in full; the optimizer step's bandwidth
      # against torch's fused AdamW at large and xl (ours in its 4-byte form beside it); the train sweep with two
      # passes forced beside the default (does two passes on host descriptors now beat the one pass at 4096 keys:
      # `ONE_PASS_MIN_KEYS`) and cuDNN.
      gpu_tests session65 200 tests/test_kernels_flash_attention.py tests/test_kernels_flash_launch_plan.py \
        tests/test_kernels_adamw.py tests/test_weight_copies.py tests/test_step_graph.py
      timeout 90 python3 scripts/adamw_bandwidth.py --results-dir "$R" 2>&1 | tail -16
      timeout 130 python3 -m cs336_systems.bench attention --sweep train --provider triton,triton-two-pass-bwd,sdpa-cudnn \
        --rep-ms 500 --no-progress --results-dir "$R" 2>&1 | tail -14
      ;;
    session64)
      # The passes on the host's tensor descriptors (~7.5 min, H100 or H200): session64-short, then the attention train
      # sweep against cuDNN with them off and on (CS336_FLASH_HOST_DESCRIPTORS, recorded in the rows' switches).
      run_stage session64-short
      CS336_FLASH_HOST_DESCRIPTORS=0 attention_train_sweep
      CS336_FLASH_HOST_DESCRIPTORS=1 attention_train_sweep
      ;;
    session64-short)
      # Their GPU tests (~4.5 min: kernels bit-equal to the shipped ones at every tuned tile; Python and native launch
      # plans replaying them over new tensors), then session64-tune.
      gpu_tests session64 150 tests/test_kernels_flash_attention.py tests/test_kernels_flash_launch_plan.py \
        -k "host_descriptors"
      run_stage session64-tune
      ;;
    session64-tune)
      # Their tiles beside the shipped ones (~2 min) at two d 64 shapes where ours trails cuDNN.
      timeout 100 python3 -m cs336_systems.bench attention-tune --compile-workers 8 \
        --shape 4x20x2048x64,4x32x4096x64 \
        --kernel forward-gluon-late,forward-gluon-late-host,dkdv-gluon-kv,dkdv-gluon-host,dq-gluon,dq-gluon-host \
        --top 30 --no-progress --results-dir "$R" 2>&1 | grep -v Warning | grep -E "^[0-9]+x|^\|" | tail -40
      ;;
    session63)
      # The passes on the host's tensor descriptors (~6 min, H100 or H200): their GPU tests (every tuned tile,
      # contiguous and head views, ragged lengths; bit-equal to the shipped kernels), then their tiles beside the
      # shipped ones (the d 64 dK/dV pass holds K and V in registers: `-kv`) at the d 64 shapes where ours trails
      # cuDNN (short rows, many heads: each program's descriptors are a fixed cost), each shape printed when done.
      gpu_tests session63 170 tests/test_kernels_flash_attention.py -k "host_descriptors or gluon_forward_matches"
      timeout 160 python3 -m cs336_systems.bench attention-tune --compile-workers 8 \
        --shape 4x20x2048x64,4x32x4096x64,4x12x512x64,4x32x16384x64 \
        --kernel forward-gluon-late,forward-gluon-late-host,dkdv-gluon-kv,dkdv-gluon-host,dq-gluon,dq-gluon-host \
        --top 30 --no-progress --results-dir "$R" 2>&1 | grep -v Warning | grep -E "^[0-9]+x|^\|" | tail -40
      ;;
    session62-short)
      # The warp-specialised forward's consumers taking turns at the tensor cores (~3.5 min; run it at 84d9f4a12188:
      # the turns were measured slower and withdrawn after, notes/flash_attention.md): its GPU tests, then the forward
      # with and without the turns at three shapes.
      gpu_tests session62 80 tests/test_kernels_flash_attention.py -k "warp_specialised_forward"
      timeout 110 python3 -m cs336_systems.bench attention-tune --compile-workers 8 \
        --shape 1x32x32768x128,4x32x16384x64,4x32x4096x64 --kernel forward-gluon-ws,forward-gluon-ws-pingpong \
        --top 30 --no-progress --results-dir "$R" 2>&1 | grep -v Warning | tail -30
      ;;
    session61)
      # The exponentials on the FMA units and the three-consumer forward (~7 min, H100 or H200; run it at b0229596fa9d:
      # both were measured slower and withdrawn after, notes/flash_attention.md): the forwards' GPU tests (1 and 2 of
      # every 4 exponentials from the polynomial; every warp-specialised tile, 192 rows included), then the Gluon
      # forwards' tiles with 0, 1 and 2 at the d 64 train shapes, the large model's own (4x20x2048x64) and the 8B's
      # (1x32x32768x128), in one run.
      gpu_tests session61 150 tests/test_kernels_flash_attention.py \
        -k "fma_units or gluon_forward_matches or warp_specialised_forward"
      timeout 300 python3 -m cs336_systems.bench attention-tune --compile-workers 4 \
        --shape 4x32x4096x64,4x32x16384x64,1x1x65536x64,4x20x2048x64,1x32x32768x128 \
        --kernel forward-gluon-late,forward-gluon-late-fma1,forward-gluon-late-fma2,forward-gluon-ws,forward-gluon-ws-fma1,forward-gluon-ws-fma2 \
        --top 40 --no-progress --results-dir "$R" 2>&1 | grep -v Warning | tail -60
      ;;
    session60)
      # The residual add fused into RMSNorm op by op (~1 min, H100 or H200; carry [".whl"] for Liger): at the 8B's
      # shape (32768 tokens, d 4096, bf16), ours fused against ours unfused, torch and Liger's fused add + RMSNorm;
      # the plain RMSNorm beside it.
      liger_on_path
      timeout 120 python3 -m cs336_systems.bench fused-ops --op rmsnorm,add-rmsnorm --no-progress --results-dir "$R" \
        2>&1 | tail -10
      ;;
    session59-8b)
      # The 8B step beside the baseline alone (~4 min, H200), at the commit passed in.
      leaderboard_step 230
      ;;
    session59)
      # The least of session57 (~6 min, H200): the 8B step beside the baseline, then the attention train sweep against
      # cuDNN, at the commit passed in.
      leaderboard_step 240
      attention_train_sweep
      ;;
    session58)
      # RMSNorm's bandwidth by warps per program and backward programs (~1 min), then xl at ctx 512 compiled with the
      # step graph, with and without the fused residual add, against the baseline (~2 min; H100 or H200).
      timeout 60 python3 scripts/rmsnorm_warps.py 2>&1 | tail -20
      step_graph_sizes 130 xl 512 on on --residual-norm on,off
      ;;
    session57)
      # The rest at the same commit (~8 min, H200): xl at ctx 512 with and without the fused add, RMSNorm's bandwidth by
      # warps per program (scripts/rmsnorm_warps.py), then the 8B step
      # beside the baseline (issue 35; issue 32: nothing else slower) and the attention train sweep against cuDNN.
      step_graph_sizes 130 xl 512 on on --residual-norm on,off
      timeout 60 python3 scripts/rmsnorm_warps.py 2>&1 | tail -20
      leaderboard_step 250
      attention_train_sweep
      ;;
    session55)
      # The step graph's capture with the warm-up's gradients dropped first (~2 min): xl at ctx 512, compiled, ours
      # against the baseline (the baseline ran out of memory there on an H100 before).
      step_graph_sizes 110 xl 512 on on
      ;;
    session54)
      # Where the GPU-bound sizes' steps go (~4 min, H100 or H200): the kernel profile of medium and large at ctx 2048,
      # compiled per block, ours against the baseline (the best-mode ratio is 0.94-0.95 there: which kernels beside
      # the products take the time).
      timeout 200 python3 -m cs336_systems.bench model --preset medium,large --context 2048 --dtype bf16 --compile on \
        --compile-scope block --provider ours,baseline --attention triton --fused --optimizer fused \
        --mode train-step --profile --no-progress --results-dir "$R" 2>&1 | tail -6
      ;;
    session53-sizes)
      # The least of session53 (~3 min, H200): every size at ctx 512, compiled with the step graph, both providers.
      step_graph_sizes 170 small,medium,large,xl 512 on on
      ;;
    session53-short)
      # session53 where less device time is left (~6 min, H200): compiled with the step graph only, then the 8B step.
      step_graph_sizes 150 small,medium,large,xl 512 on on
      leaderboard_step 250
      ;;
    session53)
      # The step graph on the card (~8 min, H200: pass needs_h200, xl fits beside the baseline there): every
      # size at ctx 512, eager and compiled, graphed, ours against the baseline; then the 8B step beside the baseline
      # (issue 32: nothing else slower; issue 35), then the attention train sweep against cuDNN.
      step_graph_sizes 200 small,medium,large,xl 512 off,on on
      leaderboard_step 250
      attention_train_sweep
      ;;
    session52)
      # The step graph where session50/51 left gaps (~5 min): large at ctx 128, eager and compiled; xl at ctx 512 and
      # 128 (and 2048 eager: the compiled xl does not fit beside the baseline there), ours against the baseline.
      step_graph_sizes 100 large 128 off,on on
      step_graph_sizes 130 xl 512,128 off,on on
      step_graph_sizes 70 xl 2048 off on
      ;;
    session51)
      # The step graph at the other contexts (~6 min): small and medium at ctx 128 and 2048, eager and compiled per
      # block with the step graph, ours against the baseline, 2 interleaved rounds; then large at ctx 2048.
      step_graph_sizes 250 small,medium 128,2048 off,on on --rounds 2
      step_graph_sizes 100 large 2048 off on
      ;;
    session49)
      # The next session's first call (~8 min, H100 or H200): the fused forms as subclasses (the twentieth session, CPU
      # only) -- their GPU tests with the compiled model and a CUDA-graph capture; what a compiled block's guard check
      # costs inside a step on this host, ours against the baseline; then every size at ctx 512 in the three modes.
      gpu_tests session49 100 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py tests/test_weight_copies.py \
        -k "rope or rmsnorm or fused or opcheck_kernels or compiles_with_the_kernels or cuda_graph or copies"
      timeout 60 python3 scripts/guard_check_cost.py --device cuda --preset small --context 512 2>&1 | tail -4
      every_size 300 512 off,on,reduce-overhead --rounds 2
      # what dynamo's guard checks cost the compiled steps of small and medium, both providers
      timeout 100 python3 -m cs336_systems.bench model --preset small,medium --context 512 --dtype bf16 \
        --compile on,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --rounds 2 --skip-guards --no-progress \
        --results-dir "$R" 2>&1 | tail -10
      ;;
    session48)
      # Whole-model CUDA graphs (~3 min): small at ctx 512 compiled as one region (the hidden states' forward: one
      # guard check and one graph replay a step where per-block compiling has twelve of each), ours against the
      # baseline compiled the same way, 2 interleaved rounds.
      timeout 170 python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 \
        --compile reduce-overhead --compile-scope model --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --rounds 2 --no-progress --results-dir "$R" \
        2>&1 | tail -5
      ;;
    session47)
      # Where small's step goes with the fused loss (~4 min, H100 or H200): the kernel profile at ctx 512 compiled, ours
      # against the baseline, then the host profile (cProfile and torch.profiler's CPU time) of the CUDA-graph and
      # eager steps, ours, ours with the plain loss and the baseline (text files under results/host_profile).
      timeout 100 python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 --compile on \
        --compile-scope block --provider ours,baseline --attention triton --fused --optimizer fused \
        --mode train-step --profile --no-progress --results-dir "$R" 2>&1 | tail -4
      timeout 150 python3 scripts/step_host_profile.py --preset small --context 512 --compile reduce-overhead,off \
        --variants baseline,ours,ours-plain-loss --steps 20 --top 25 --out "$R/host_profile" 2>&1 | grep -v USDT \
        | tail -10
      ;;
    session46)
      # The shortest H200 call for issue 35 (~5 min; pass needs_h200): the 8B step beside the baseline with short
      # timing at today's code (its loss now takes the mean's scale on the device), then the attention train sweep.
      leaderboard_step 260 15000
      attention_train_sweep
      ;;
    session45)
      # The fused loss at the other contexts (~8 min, H100 or H200): small, medium and large at ctx 2048 and 128 in the
      # three modes, the fused loss on and off beside the baseline, 2 interleaved rounds; then xl at ctx 2048.
      timeout 420 python3 -m cs336_systems.bench model --preset small,medium,large --context 2048,128 --dtype bf16 \
        --compile off,on,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --fused-loss on,off --mode train-step --warmup 3 --steps 8 --rounds 2 --no-progress \
        --results-dir "$R" 2>&1 | tail -40
      timeout 60 python3 -m cs336_systems.bench model --preset xl --context 2048 --dtype bf16 \
        --compile off,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -6
      ;;
    session44)
      # The fused loss (~9 min, H100 or H200): ours takes its training loss by our fused LM head + cross-entropy
      # (its products reading the head's bf16 copy) instead of the logits and torch's cross_entropy. Its GPU tests,
      # then small, medium and large at ctx 512 in the three modes with the fused loss on and off, beside the
      # baseline, 2 interleaved rounds; then xl the same way, as far as the time goes.
      gpu_tests session44 120 tests/test_kernels_cross_entropy.py tests/test_weight_copies.py tests/test_operators.py \
        -k "cross_entropy or fused_loss or lm_head or copies"
      timeout 330 python3 -m cs336_systems.bench model --preset small,medium,large --context 512 --dtype bf16 \
        --compile off,on,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --fused-loss on,off --mode train-step --warmup 3 --steps 8 --rounds 2 --no-progress \
        --results-dir "$R" 2>&1 | tail -22
      timeout 110 python3 -m cs336_systems.bench model --preset xl --context 512 --dtype bf16 \
        --compile off,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --fused-loss on,off --mode train-step --warmup 3 --steps 8 --no-progress \
        --results-dir "$R" 2>&1 | tail -8
      ;;
    session43)
      # The next session's first call (~8 min, H200 or H100): RMSNorm's backward as before the seventeenth session (its
      # runs of rows took 26 us a call at small/512 on an H100, 98a78042), its GPU tests; then every size at ctx 512 in
      # the three modes, 2 interleaved rounds (a configuration that does not fit twice is timed one provider at a
      # time), and small's kernel profile compiled, ours against the baseline.
      gpu_tests session43 100 tests/test_kernels_rmsnorm_swiglu.py -k "rmsnorm"
      every_size 330 512 off,on,reduce-overhead --rounds 2
      timeout 100 python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 --compile on \
        --compile-scope block --provider ours,baseline --attention triton --fused --optimizer fused \
        --mode train-step --profile --no-progress --results-dir "$R" 2>&1 | tail -4
      ;;
    session42)
      # The shortest cut (~4.5 min), for a call with little device time left: the GPU tests of RoPE's Q/K pair and
      # RMSNorm's backward (both in the default fused model since the seventeenth session, never yet run on a GPU),
      # then every size at ctx 512 eagerly and as CUDA graphs (the rows come back as the sweep goes).
      gpu_tests session42 110 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py \
        -k "rope or rmsnorm or opcheck_kernels or compiles_with_the_kernels or cuda_graph"
      every_size 150 512 off,reduce-overhead
      ;;
    session41)
      # session39 cut to what fits the last minutes of a session (~6 min): the GPU tests of RoPE's Q/K pair and RMSNorm's
      # backward, then every size at ctx 512 in the three modes, ours and the baseline in 2 interleaved rounds.
      gpu_tests session41 120 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py \
        -k "rope or rmsnorm or opcheck_kernels or compiles_with_the_kernels or cuda_graph"
      every_size 250 512 off,on,reduce-overhead --rounds 2
      ;;
    session39)
      # For the next session's H200 (~9 min): every size at ctx 512
      # in the three modes at today's code (issue 32's table on its card; the warm-up by time's first GPU run), ours
      # and the baseline in 3 interleaved rounds each (--rounds: the host's drift weighs on both alike). First the
      # GPU tests of RoPE's Q/K pair (one launch for both; the seventeenth session), RMSNorm's backward (rows taken
      # several a step) and the compiled model over them; last, the d 64 forward's tiles at the model's own shapes (the
      # default moved to 64 x 64 for keys <= 4096 in the sixteenth session, measured at 4x32x4096x64 only).
      gpu_tests session39 120 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py \
        -k "rope or rmsnorm or opcheck_kernels or compiles_with_the_kernels or cuda_graph"
      python3 -m cs336_systems.bench fused-ops --op rmsnorm --tokens 2048,32768 --width 768,4096 \
        --provider ours,torch --no-progress --results-dir "$R" 2>&1 | tail -10
      every_size 330 512 off,on,reduce-overhead --rounds 3
      timeout 90 python3 -m cs336_systems.bench attention-tune --compile-workers 4 --shape 4x12x512x64,4x12x2048x64 \
        --kernel forward-gluon-late,forward-gluon-ws,fused-gluon-ws,dkdv-gluon-kv,dq-gluon --no-progress \
        --results-dir "$R" 2>&1 | grep -v Warning | tail -8
      ;;
    session40)
      # The next session's second H200 call (~8 min): the attention tests the sixteenth session's last changes touched
      # (the default backward's rule, the d 64 one pass's first causal row), issue 35's attention targets once, then
      # the 8B step beside the baseline (needs the H200's memory: pass needs_h200).
      gpu_tests session40 130 tests/test_kernels_flash_attention.py \
        -k "choice or default_kernels or gluon_backward_matches or first_causal_row or warp_specialised"
      TARGET_RUNS=1 run_stage attention-targets
      run_stage leaderboard-quick
      ;;
    session38)
      # The sixteenth session's third call (~7 min): the d 64 defaults chosen from session37 (one pass where its
      # programs fill the GPU; the forward by length) -- their GPU tests, the train sweep and the single-head target
      # cases against cuDNN (the default `triton` beside the two deterministic passes), then the model's own d 64
      # shapes (batch 4, 12 heads, ctx 512 and 2048) with kernel time.
      gpu_tests session38 130 tests/test_kernels_flash_attention.py \
        -k "choice or default_kernels or gluon_backward_matches or gluon_forward_matches or warp_specialised_one_pass"
      python3 -m cs336_systems.bench attention --sweep train --provider triton,triton-two-pass-bwd,sdpa-cudnn \
        --rep-ms 1000 --no-progress --results-dir "$R" 2>&1 | tail -16
      python3 -m cs336_systems.bench attention --sweep flash --d 64,128 --dtype bf16 --seq 8192,16384,32768,65536 \
        --provider triton,triton-two-pass-bwd,sdpa-cudnn --rep-ms 200 --kernel-time --no-progress \
        --results-dir "$R" 2>&1 | tail -28
      python3 -m cs336_systems.bench attention --batch 4 --heads 12 --seq 512,2048 --d 64 --dtype bf16 \
        --provider triton,triton-two-pass-bwd,sdpa-cudnn --rep-ms 100 --kernel-time --no-progress \
        --results-dir "$R" 2>&1 | tail -8
      ;;
    session37)
      # The sixteenth session's second attention call (~8 min): the warp-specialised one-pass backward at d 64 (the
      # consumers taking turns at dQ): its GPU tests, its tiles beside the two passes and the forward kernels at the
      # d 64 shapes (4 compile workers: 12 ran the GPU out of memory at 4x32x16384x64), then ours with each backward
      # against cuDNN on the train sweep and the single-head d 64 cases, in one run.
      gpu_tests session37 200 tests/test_kernels_flash_attention.py -k "warp_specialised or gluon_one_pass"
      timeout 240 python3 -m cs336_systems.bench attention-tune --compile-workers 4 \
        --shape 4x32x4096x64,4x32x16384x64,1x1x16384x64,1x1x65536x64 \
        --kernel forward-gluon-late,forward-gluon-ws,dkdv-gluon-kv,dq-gluon,fused-gluon-ws \
        --no-progress --results-dir "$R" 2>&1 | grep -v Warning | tail -48
      python3 -m cs336_systems.bench attention --sweep train --provider triton,triton-fused-bwd,sdpa-cudnn \
        --rep-ms 1000 --no-progress --results-dir "$R" 2>&1 | tail -16
      python3 -m cs336_systems.bench attention --sweep flash --d 64 --dtype bf16 --seq 8192,16384,32768,65536 \
        --provider triton,triton-fused-bwd,sdpa-cudnn --rep-ms 200 --kernel-time --no-progress \
        --results-dir "$R" 2>&1 | tail -14
      ;;
    session36)
      # The sixteenth session's attention call (~6 min): every tile config of the d 64 kernels at the train sweep's
      # shapes where ours is furthest behind cuDNN (4x32x4096x64: fwd+bwd 0.91, tuned before at 16384 only), with
      # SDPA's backends timed in the same run, then the attention targets once at this commit.
      timeout 330 python3 -m cs336_systems.bench attention-tune --compile-workers 4 --shape 4x32x4096x64,4x32x16384x64 \
        --kernel forward-gluon,forward-gluon-late,forward-gluon-ws,dkdv-gluon,dkdv-gluon-kv,dq-gluon,fused-gluon-s1 \
        --no-progress --results-dir "$R" 2>&1 | tail -70
      TARGET_RUNS=1 run_stage attention-targets
      ;;
    session35)
      # The fifteenth session's check of the time-based warm-up (--warmup-s, 1 s by default on CUDA): small and
      # medium at ctx 128 and 512, eager and as CUDA graphs, the sweep's own options otherwise (~3 min).
      timeout 240 python3 -m cs336_systems.bench model --preset small,medium --context 128,512 --dtype bf16 \
        --compile off,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -12
      ;;
    session34)
      # The fifteenth session's H100 call, where no H200 came (~9.5 min): every size at ctx 512 in the three modes at
      # today's code (the weights' bf16 copies on by default), then small's host time eager and as CUDA graphs, ours
      # against the baseline (the compiled mode's was profiled in the ninth session).
      every_size 330 512 off,on,reduce-overhead
      lscpu | grep -E "Model name|^CPU\(s\)"
      timeout 230 python3 scripts/step_host_profile.py --preset small --context 512 --compile off,reduce-overhead \
        --steps 10 --variants ours,baseline --out "$R/host_profile" 2>&1 | grep -vE "USDT|profiler_st" | tail -8
      ;;
    session33)
      # The fifteenth session's H200 call (~9 min): every size at ctx 512 in the three modes (issue 32's table on
      # its card; session25 the same at ctx 2048 and 128), then the 8B step beside the baseline (issue 35; it needs the
      # H200's memory) with the tiny --verify first.
      every_size 330 512 off,on,reduce-overhead
      run_stage leaderboard
      ;;
    session26)
      # The thirteenth session's second call (~8 min): every size at ctx 512 in the three modes (with session25, one
      # card and one commit for the whole size table), then xl at ctx 512 profiled, ours against the baseline (kernel
      # time per kind: how much xl's head dim 80, padded to 128 in our kernels, costs).
      every_size 330 512 off,on,reduce-overhead
      timeout 150 python3 -m cs336_systems.bench model --preset xl --context 512 --dtype bf16 --provider ours,baseline \
        --compile on --compile-scope block --attention triton --fused --optimizer fused --mode train-step --profile \
        --warmup 3 --steps 5 --no-progress --results-dir "$R" > "$OUT/profile_xl.log" 2>&1
      grep -A3 "^| preset" "$OUT/profile_xl.log" | head -8
      ;;
    session25)
      # The thirteenth session's sweep (~10 min): every size at ctx 2048 and 128, eager, compiled and as CUDA graphs
      # against the baseline, at today's code (the rows there were from before the merged products' compile fix).
      every_size 330 2048 off,on,reduce-overhead
      every_size 230 128 off,on,reduce-overhead
      ;;
    session22)
      # The eleventh session's first call (~8 min): fuzz case 8's dV taken apart on the GPU (the kernels' row
      # statistics and dV against fp64, dV rebuilt from each ingredient, the dV pass per tile config), the compiled
      # model's GPU tests (head split and merge as views, the constant-result predicates), then every size at ctx 512
      # eager, compiled and as CUDA graphs against the baseline.
      CS336_AUTOTUNE=0 timeout 90 python3 scripts/flash_dv_probe.py --case 8 > "$OUT/dv_probe_case8.txt" 2>&1
      cat "$OUT/dv_probe_case8.txt" | tail -20
      gpu_tests session22 90 tests/test_operators.py tests/test_kernels_flash_attention.py \
        -k "compiles_with_the_kernels or cuda_graph or native"
      every_size 270 512 off,on,reduce-overhead
      ;;
    session24)
      # The twelfth session's check (~4 min): the fp32 backward's exp2 back on the instruction (the polynomial
      # left 2 fp32 fuzz cases over budget, the instruction 1: stage fp32-variants): the fp32 GPU fuzz and the
      # FlashAttention tests at the landed code.
      gpu_tests session24 240 tests/test_kernels_flash_fuzz.py tests/test_kernels_flash_attention.py \
        -k "(fuzz and gpu and fp32) or flash_attention"
      ;;
    session21)
      # The fp32 checks alone (~2.5 min): exp2's accuracy, fuzz case 8's ratios, the fp32 GPU fuzz.
      fp32_case8_checks
      gpu_tests session21 90 tests/test_kernels_flash_fuzz.py \
        -k "fuzz and gpu and fp32"
      ;;
    session18)
      # The tenth session's checks in one call (~9 min): the exp2 and case-8 checks, the GPU tests of its kernel
      # and model changes, then every size at ctx 512 eager, compiled and as CUDA graphs against the baseline
      # (session16 adds xl's profile and ctx 128 / 2048).
      fp32_case8_checks
      gpu_tests session18 150 tests/test_kernels_flash_fuzz.py \
        tests/test_kernels_flash_attention.py tests/test_kernels_flash_launch_plan.py tests/test_operators.py \
        -k "(fuzz and gpu and fp32) or forward or native or compiles_with_the_kernels or cuda_graph"
      every_size 270 512 off,on,reduce-overhead
      ;;
    session16)
      # The tenth 2026-12-06 session's first call (~8 min): fp32's IEEE-rounded 1 / l and O = acc / l (Triton's `/`
      # is div.full.f32): the fuzz case 8 ratios, the fp32 GPU fuzz and the FlashAttention tests; the native operator
      # wrappers (review commit); RoPE; then xl at ctx 512 profiled (kernel time per kind, ours against the
      # baseline) and small/medium at ctx 128 and 2048 as CUDA graphs.
      fp32_case8_checks
      gpu_tests session16 200 tests/test_kernels_flash_fuzz.py tests/test_kernels_flash_attention.py \
        tests/test_kernels_flash_launch_plan.py tests/test_operators.py tests/test_kernels_rmsnorm_swiglu.py \
        -k "(fuzz and gpu and fp32) or flash_attention or native or operators or rope or one_product"
      timeout 150 python3 -m cs336_systems.bench model --preset xl --context 512 --dtype bf16 --provider ours,baseline \
        --compile on --compile-scope block --attention triton --fused --optimizer fused --mode train-step --profile \
        --warmup 3 --steps 5 --no-progress --results-dir "$R" > "$OUT/profile_xl.log" 2>&1
      grep -A3 "^| preset" "$OUT/profile_xl.log" | head -8
      timeout 110 python3 -m cs336_systems.bench model --preset small,medium --context 128,2048 --dtype bf16 \
        --compile reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -10
      ;;
    session14)
      # The ninth session's last call (~7 min): RoPE's heads split over programs where batch x position blocks are
      # too few (its GPU tests and opcheck, the compiled model's), then every size at ctx 512 eager, compiled and as
      # CUDA graphs against the baseline, then ctx 128 and 2048 as CUDA graphs (each side's best mode) for the
      # sizes the time left allows.
      gpu_tests session14 90 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py \
        -k "rope or one_product or compiles_with_the_kernels or cuda_graph"
      every_size 270 512 off,on,reduce-overhead
      timeout 100 python3 -m cs336_systems.bench model --preset small,medium --context 128,2048 --dtype bf16 \
        --compile reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -10
      ;;
    session15)
      # session14 cut to what a short budget allows (~4 min): RoPE's GPU tests, then every size at ctx 512 compiled
      # and as CUDA graphs against the baseline (the sizes the time limit allows, smallest first).
      gpu_tests session15 60 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py -k "rope"
      every_size 150 512 on,reduce-overhead
      ;;
    session9)
      # The eighth 2026-12-05 session's call (~9 min; carry [".whl"] for Liger): (1) the GPU tests of what it
      # changed: our pointwise operators as triton_ops by default under torch.compile, the merged Q/K/V and w1/w3
      # products kept when compiled (the weights concatenated in the graph), the packed SwiGLU gate's operators, the
      # fused CE's first-chunk product and its scaling that skips a gradient of 1; (2) every size at ctx 512 eager,
      # compiled and as CUDA graphs, ours against the baseline; (3) the fused CE against Liger at the leaderboard's
      # shape; (4) issue 35's d 256 attention against d 128.
      gpu_tests session9 130 tests/test_operators.py tests/test_kernels_rmsnorm_swiglu.py \
        tests/test_kernels_cross_entropy.py -k "compile or opcheck or packed or cuda_graph or merged or cross_entropy"
      every_size 240 512 off,on,reduce-overhead
      liger_on_path
      timeout 90 python3 -m cs336_systems.bench cross-entropy --tokens 8192,32768 --provider fused,fused-lean,liger \
        --no-progress --results-dir "$R" 2>&1 | tail -5
      ATTN_D256_TIMEOUT=100 run_stage attention-d256
      ;;
    session10)
      # The eighth 2026-12-05 session's last call (~6 min): the merged products under torch.compile again (session9
      # found them off on torch 2.11: dynamo did not resolve the Linears' patched forward; now a mark decides),
      # its GPU tests, every size at ctx 512 compiled and as CUDA graphs, and a compiled small step's host time.
      gpu_tests session10 100 tests/test_operators.py -k "one_product or compiles_with_the_kernels or cuda_graph"
      every_size 200 512 on,reduce-overhead
      timeout 100 python3 scripts/step_host_profile.py --preset small --context 512 --compile on --steps 10 \
        --variants ours,baseline --out "$R/host_profile" 2>&1 | grep -v Warn | tail -4
      ;;
    session11)
      # The eighth 2026-12-05 session's short last call (~90 s): the block norms storing autocast's dtype
      # (`rmsnorm(..., out_dtype=)`) on the GPU: its tests and opcheck, and small/medium at ctx 512 compiled and as
      # CUDA graphs against the baseline.
      gpu_tests session11 45 tests/test_kernels_rmsnorm_swiglu.py tests/test_operators.py \
        -k "out_dtype or autocast_dtype or (opcheck and rmsnorm) or one_product"
      timeout 45 python3 -m cs336_systems.bench model --preset small,medium --context 512 --dtype bf16 \
        --compile on,reduce-overhead --compile-scope block --provider ours,baseline --attention triton --fused \
        --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -9
      ;;
    attention)
      python3 -m cs336_systems.bench attention --sweep train --provider triton,sdpa-flash,sdpa-cudnn \
        --rep-ms 50 --no-progress --results-dir "$R" 2>&1 | tail -30
      python3 -m cs336_systems.bench attention --sweep flash --seq 1024,4096,8192,16384,32768,65536 --d 64,128 \
        --dtype bf16 --provider naive,triton,sdpa-flash,sdpa-cudnn --rep-ms 50 --no-progress --results-dir "$R" \
        --plot "$R/attention_tflops.png" 2>&1 | tail -45
      ;;
    attention-train)
      # ATTN_TRAIN_PROVIDERS narrows or widens it (triton-two-pass-bwd: the deterministic passes; triton-tl-bwd:
      # the tl ones; triton-fused-bwd: one pass at every head dim).
      # ATTN_TRAIN_REP_MS: timing per measurement (50 ms was a single fwd+bwd at 1x32x32768x128: +-0.5 ms apart
      # between runs).
      python3 -m cs336_systems.bench attention --sweep train \
        --provider "${ATTN_TRAIN_PROVIDERS:-triton,triton-two-pass-bwd,sdpa-flash,sdpa-cudnn}" \
        --rep-ms "${ATTN_TRAIN_REP_MS:-1000}" --no-progress --results-dir "$R" 2>&1 | tail -40
      ;;
    attention-tune)
      # Every tile config of each kernel at the two target shapes (compiled by 12 processes first).
      # ATTN_TUNE_KERNELS / ATTN_TUNE_SHAPES narrow it, e.g. ATTN_TUNE_KERNELS=dkdv,dq ATTN_TUNE_SHAPES=1x32x32768x128
      python3 -m cs336_systems.bench attention-tune --kernel "${ATTN_TUNE_KERNELS:-forward,forward-tma,dkdv,dkdv-tma,dq,dq-tma}" \
        --shape "${ATTN_TUNE_SHAPES:-1x32x32768x128,4x32x16384x64}" --no-progress --results-dir "$R" 2>&1 | tail -45
      ;;
    attention-full)  # both handout sweeps, as the two stages below
      run_stage attention-flash
      run_stage attention-handout
      ;;
    attention-flash)
      # FLASH_D / FLASH_DTYPE / FLASH_SEQ / FLASH_PROVIDERS narrow it (comma lists); --kernel-time adds each
      # measurement's GPU kernel time (metric kernel_time; FLASH_KERNEL_TIME=0 leaves it out, 23 calls more per
      # measurement: about 5 s for the naive fwd+bwd at seq 65536). One head dim in both dtypes takes about
      # 9 min (d 32: bf16 3.2 min; fp32's first case alone 162 s, mostly compiles, before --precompile-workers),
      # so all four do not fit in one 10-minute call.
      python3 -m cs336_systems.bench attention --sweep flash --d "${FLASH_D:-16,32,64,128}" \
        --dtype "${FLASH_DTYPE:-bf16,fp32}" ${FLASH_SEQ:+--seq "$FLASH_SEQ"} ${FLASH_PROVIDERS:+--provider "$FLASH_PROVIDERS"} \
        --rep-ms 40 $([ "${FLASH_KERNEL_TIME:-1}" = 1 ] && echo --kernel-time) --no-progress \
        --results-dir "$R" \
        --plot "$R/attention_flash_sweep.png" 2>&1 | tail -20
      ;;
    attention-native)
      # Launch plans (Python and C++ replay): their GPU tests, the host cost of a call with each launcher, and the
      # short single-head cases (the host-bound ones) with kernel time beside wall time.
      CS336_AUTOTUNE=0 timeout 300 python3 -m pytest -q -n 8 -x -rfE -p no:cacheprovider \
        tests/test_kernels_flash_launch_plan.py 2>&1 | tee "$OUT/tests_launch_plan.log" | tail -15
      python3 scripts/attention_host_overhead.py --seq 8192 --d 64 \
        --out "$R/attention_host_overhead_d64_seq8192.txt" 2>&1 | head -12
      python3 -m cs336_systems.bench attention --sweep flash --d 64,128 --dtype bf16 --seq 8192,16384 \
        --provider triton,triton-native,sdpa-flash,sdpa-cudnn --rep-ms 40 --kernel-time --no-progress \
        --results-dir "$R" 2>&1 | tail -30
      ;;
    attention-targets)
      # Issue 4's target cases in one run at this commit: the single-head sweep's bf16 d 64/128 seq >= 8192 with
      # both launchers (kernel time beside wall), TARGET_RUNS times (default 2: the spread between runs of a
      # host-sensitive short call), then the multi-head training shapes with 1 s of timing per measurement.
      for run in $(seq "${TARGET_RUNS:-2}"); do
        echo "--- single-head target cases, run $run"
        python3 -m cs336_systems.bench attention --sweep flash --d 64,128 --dtype bf16 --seq 8192,16384,32768,65536 \
          --provider triton,triton-python,sdpa-flash,sdpa-cudnn --rep-ms 200 --kernel-time --no-progress \
          --results-dir "$R" 2>&1 | tail -28
      done
      python3 -m cs336_systems.bench attention --sweep train --provider triton,sdpa-flash,sdpa-cudnn \
        --rep-ms 1000 --no-progress --results-dir "$R" 2>&1 | tail -16
      ;;
    fp32-error)
      # The fp32 gradients' compensated accumulators (backward.add_compensated): the fp32 cases of the full GPU
      # matrix (once 1.66x over budget at 2048), the compensated-sum test, then the error split by ingredient.
      CS336_AUTOTUNE=0 timeout 300 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_kernels_flash_attention.py tests/test_kernels_compensated_sum.py \
        -k "(full_matrix and dtype2) or compensated" 2>&1 | tee "$OUT/tests_fp32_error.log" | tail -12
      # CS336_AUTOTUNE=0: an accuracy diagnostic needs no tuning, and tuning fp32 compiles every candidate first
      # (it did not finish in 75 s per backward on the H200).
      for backward in two-pass fused; do
        CS336_AUTOTUNE=0 python3 scripts/flash_fp32_error.py --seq 2048 --d 64 --seeds 0,1,2 --backward $backward \
          --out "$R/flash_fp32_error_$backward.csv" 2>&1 | tail -20
      done
      ;;
    fp32-precision)
      # fp32's dot precisions (precision.py): the tf32x3 and selection tests and the IEEE fp32 GPU matrix, then
      # IEEE and tf32x3 beside SDPA-efficient (3xTF32 itself); FLASH_D / FLASH_SEQ narrow the sweep.
      CS336_AUTOTUNE=0 timeout 240 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_kernels_flash_fp32_precision.py tests/test_kernels_flash_attention.py \
        -k "precision or tf32x3 or (full_matrix and dtype2 and not compile)" 2>&1 \
        | tee "$OUT/tests_fp32_precision.log" | tail -12
      python3 -m cs336_systems.bench attention --sweep flash --d "${FLASH_D:-32,64,128}" --dtype fp32 \
        --seq "${FLASH_SEQ:-2048,8192,32768}" --provider triton,triton-tf32x3,sdpa-efficient --rep-ms 40 \
        --no-progress --results-dir "$R" 2>&1 | tail -30
      ;;
    tests-native-build)
      # Issue 36: the native launcher's build (kernels/native_build.py) from a cold cache and then warm, each in a
      # fresh process beside a leftover cpp_extension lock (which used to hang it); then the launch-plan GPU tests and
      # the build tests from a cold cache again, 8 workers asking for the build at once.
      export CS336_EXTENSIONS_DIR=/tmp/cs336_extensions_cold TORCH_EXTENSIONS_DIR=/tmp/torch_extensions_stale
      rm -rf "$CS336_EXTENSIONS_DIR"; mkdir -p "$TORCH_EXTENSIONS_DIR/cs336_flash_native"
      touch "$TORCH_EXTENSIONS_DIR/cs336_flash_native/lock"
      for cache in cold warm; do
        timeout 300 python3 -c "import time; t = time.perf_counter(); import torch
from cs336_systems.kernels.flash_attention import native_launch as n
m = n.load_module(); print('$cache cache: load_module', 'built' if m is not None else 'FAILED', f'{time.perf_counter() - t:.1f} s')" \
          2>&1 | tee -a "$OUT/native_build.log"
      done
      rm -rf "$CS336_EXTENSIONS_DIR"
      CS336_AUTOTUNE=0 timeout 400 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_kernels_flash_launch_plan.py tests/test_kernels_native_build.py tests/test_setup.py 2>&1 \
        | tee "$OUT/tests_native_build.log" | tail -15
      ls -la "$CS336_EXTENSIONS_DIR" | tee -a "$OUT/native_build.log"
      unset CS336_EXTENSIONS_DIR TORCH_EXTENSIONS_DIR
      ;;
    tests-launch-plan)
      # The launch-plan tests alone (Python and native replay, the fresh-process first backward, the random stream).
      CS336_AUTOTUNE=0 timeout 300 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider \
        tests/test_kernels_flash_launch_plan.py 2>&1 | tee "$OUT/tests_launch_plan.log" | tail -15
      ;;
    attention-host)
      # Host time per small attention call (the flash sweep's short sequences are host-bound) and its profile.
      # HOST_D / HOST_SEQ: space-separated lists (default d 64 and 128 at seq 128); HOST_LINES: lines shown per run.
      for d in ${HOST_D:-64 128}; do
        for seq in ${HOST_SEQ:-128}; do
          python3 scripts/attention_host_overhead.py --seq "$seq" --d "$d" \
            --out "$R/attention_host_overhead_d${d}_seq${seq}.txt" 2>&1 | head -${HOST_LINES:-60}
        done
      done
      ;;
    attention-handout)
      python3 -m cs336_systems.bench attention --sweep handout --no-progress --results-dir "$R" 2>&1 | tail -45
      ;;
    tests-all)
      # Every test but the multi-process ones (those run on gloo in CI), GPU tests included.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 12 -p no:cacheprovider -m "not distributed" tests 2>&1 \
        | tee "$OUT/tests_all.log" | tail -30
      ;;
    tests-gluon)
      # The Gluon backward passes against the fp64 reference and the tl passes, and the full GPU matrix.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_flash_attention.py \
        -k "gluon or full_matrix or layout or strided or every_output or linear" 2>&1 | tee "$OUT/tests_gluon.log" | tail -25
      ;;
    one-pass-ws)
      # The warp-specialised one-pass backward (hopper_one_pass.py): its GPU tests, then timed beside the two passes.
      # Time limits on both, since a wrong barrier count hangs a warp-specialised kernel instead of failing it.
      CS336_AUTOTUNE=0 timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_flash_attention.py \
        -k warp_specialised_one_pass 2>&1 | tee "$OUT/tests_one_pass_ws.log" | tail -15
      timeout 300 python3 -m cs336_systems.bench \
        attention-tune --kernel fused-gluon-ws,fused-gluon,dkdv-gluon,dq-gluon --shape 1x32x32768x128,2x16x16384x128 \
        --no-progress --results-dir "$R" 2>&1 | tail -30
      ;;
    tests-fused)
      python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_kernels_rmsnorm_swiglu.py tests/test_memory_model.py \
        tests/test_kernels_adamw.py tests/test_kernels_cross_entropy.py 2>&1 | tee "$OUT/tests_fused.log" | tail -8
      ;;
    tests-attention-fused)
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_flash_attention.py \
        tests/test_attention_registry.py -k "fused or registry" 2>&1 | tee "$OUT/tests_attention_fused.log" | tail -8
      ;;
    tests-layout)
      # The copy-free head views (RoPE, attention outputs and gradients in their inputs' layout) and the
      # fused cross-entropy's softmax-gradient kernel.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_flash_attention.py \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_kernels_cross_entropy.py tests/test_bench_leaderboard.py \
        -k "layout or copies or strided or rope or cross or fp32_both or bf16_error or profile" 2>&1 \
        | tee "$OUT/tests_layout.log" | tail -8
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
      # Regional compile (each block): one block graph per model, so xl compiles in seconds, not minutes.
      for dtype in bf16 fp32; do
        python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype $dtype --compile on \
          --compile-scope block --provider ours,baseline --warmup 2 --steps 5 --no-progress --results-dir "$R" \
          2>&1 | tail -26
      done
      ;;
    model-fused)
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype bf16 --attention triton --fused \
        --optimizer fused --mode train-step --provider ours,baseline --warmup 3 --steps 8 --no-progress \
        --results-dir "$R" 2>&1 | tail -12
      ;;
    memory)
      # Issue 5's done-when: xl, batch 4, fp32: the single-level search at ctx 2048 (out of memory recorded),
      # none/every-block at ctx 512, then the memory_profiling table (ctx 128/2048, fp32/bf16) with timelines.
      python3 -m cs336_systems.bench memory search --preset xl --context 2048 --batch 4 --steps 2 \
        --policies none,every-block,every-k:2,every-k:4,every-k:5,every-k:6,every-k:7,every-k:8,nested \
        --results-dir "$R" 2>&1 | tail -16
      python3 -m cs336_systems.bench memory search --preset xl --context 512 --batch 4 --steps 2 \
        --policies none,every-block --results-dir "$R" 2>&1 | tail -6
      python3 -m cs336_systems.bench model --preset xl --context 128,2048 --dtype fp32,bf16 \
        --mode forward,train-step --memory --warmup 1 --steps 2 --no-progress --results-dir "$R" 2>&1 | tail -14
      ;;
    memory-profile)
      # The memory_profiling table alone (forward-only and full-step peaks, timelines).
      python3 -m cs336_systems.bench model --preset xl --context 128,2048 --dtype fp32,bf16 \
        --mode forward,train-step --memory --warmup 1 --steps 2 --no-progress --results-dir "$R" 2>&1 | tail -14
      ;;
    model-triton)
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype bf16 --compile off,on \
        --attention triton --mode train-step --no-progress --results-dir "$R" 2>&1 | tail -20
      ;;
    precision)
      # The handout's accumulation loops and the toy model's dtypes under CUDA autocast (fp16 and bf16).
      for dtype in fp16 bf16; do
        python3 -m cs336_systems.bench precision --device cuda --autocast-dtype $dtype --results-dir "$R" 2>&1 | tail -12
      done
      ;;
    cross-entropy)
      # Issue 35: the fused LM head + cross-entropy (fp32 dW, and lean: dW in bf16 with Liger's chunks) against
      # Liger-Kernel, lm_head + cross_entropy and the baseline's chunked loss, at the leaderboard's shape and a
      # quarter of it: time of loss + gradients, peak memory above the inputs. Then RMSNorm and the SwiGLU gate
      # against torch and Liger (from the carried wheel: `liger_on_path`).
      liger_on_path
      python3 -m cs336_systems.bench cross-entropy --tokens 8192,32768 --no-progress --results-dir "$R" 2>&1 | tail -8
      python3 -m cs336_systems.bench fused-ops --no-progress --results-dir "$R" 2>&1 | tail -8
      ;;
    leaderboard)
      python3 -m cs336_systems.bench leaderboard --preset tiny --context 256 --verify --param-dtype bf16 \
        --provider ours --warmup-ms 50 --rep-ms 100 --no-progress --results-dir "$R" 2>&1 | tail -3
      # From an empty Triton cache (a fresh machine has none): command_wall_time is the cold start.
      # LEADERBOARD_ARGS: extra options for the 8B run (e.g. --attention triton-fused-bwd --fused-rope).
      python3 -m cs336_systems.bench leaderboard --warmup-ms 2000 --rep-ms 30000 ${LEADERBOARD_ARGS:-} \
        --results-dir "$R" 2>&1 | tail -12
      ;;
    leaderboard-profile)
      # Where the 8B step's time goes: each provider timed briefly, then one step under torch.profiler,
      # kernel time by phase and kind of work (rows: profile_category_time, profile_kernel_time).
      python3 -m cs336_systems.bench leaderboard --warmup-ms 1000 --rep-ms 4000 --profile ${LEADERBOARD_ARGS:-} \
        --results-dir "$R" 2>&1 | tail -60
      ;;
    leaderboard-quick)
      # Ours beside the baseline with short timing (warm-up 1 s, 15 s of steps: about 3 timed steps each at 8B;
      # 5 s gave do_bench a single step).
      python3 -m cs336_systems.bench leaderboard --warmup-ms 1000 --rep-ms 15000 ${LEADERBOARD_ARGS:-} \
        --results-dir "$R" 2>&1 | tail -8
      ;;
    leaderboard-rope)
      # Our Triton RoPE (the default with --fused on): ours without and with it, back to back.
      python3 -m cs336_systems.bench leaderboard --provider ours --no-fused-rope --warmup-ms 2000 --rep-ms 30000 \
        --results-dir "$R" 2>&1 | tail -6
      python3 -m cs336_systems.bench leaderboard --provider ours --fused-rope --warmup-ms 2000 --rep-ms 30000 \
        --results-dir "$R" 2>&1 | tail -6
      ;;
    multi-collectives)
      # Issue 9, on a machine of several GPUs: NCCL at 2, 4 (and 6/8 where present) ranks.
      for n in 2 4 6 8; do
        [ "$n" -le "$NGPU" ] || continue
        torchrun --standalone --nproc-per-node $n -m cs336_systems.bench collectives --device cuda \
          --results-dir "$R" --plot "$R/collectives_nccl.png" 2>&1 | tail -8
      done
      ;;
    multi-parallel)
      # Issue 10: xl on 2 GPUs: DDP variants and buckets beside torch DDP, ZeRO-1, FSDP beside FSDP2.
      torchrun --standalone --nproc-per-node 2 -m cs336_systems.bench ddp --device cuda --preset xl \
        --variant naive,flat,overlap,bucketed,torch-ddp --profile --results-dir "$R" 2>&1 | tail -14
      torchrun --standalone --nproc-per-node 2 -m cs336_systems.bench sharding --device cuda --preset xl \
        --results-dir "$R" 2>&1 | tail -8
      torchrun --standalone --nproc-per-node 2 -m cs336_systems.bench fsdp --device cuda --preset xl \
        --compute-dtype fp32,bf16 --provider fsdp,ddp,torch-fsdp2 --results-dir "$R" 2>&1 | tail -10
      ;;
    leaderboard-2gpu)
      # Issue 11: one sequence per GPU on 2 GPUs (our DDP), then the one-GPU step on the same machine.
      torchrun --standalone --nproc-per-node 2 -m cs336_systems.bench leaderboard --batch 1 --warmup-ms 2000 \
        --rep-ms 30000 --results-dir "$R" 2>&1 | tail -8
      python3 -m cs336_systems.bench leaderboard --provider ours --warmup-ms 2000 --rep-ms 30000 \
        --results-dir "$R" 2>&1 | tail -6
      ;;
    model-sizes)
      # Issue 32: our operators and compiled model on the GPU, then ours (triton attention, fused kernels, fused
      # AdamW) against the PyTorch-native baseline at every size and context, eager, train step, bf16 autocast,
      # and one profile of each at small/512 (kernel rows per phase).
      CS336_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider tests/test_operators.py \
        tests/test_kernels_rmsnorm_swiglu.py tests/test_kernels_cross_entropy.py tests/test_kernels_adamw.py \
        tests/test_attention_registry.py > "$OUT/tests_operators.log" 2>&1
      tail -3 "$OUT/tests_operators.log"
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --context 128,512,2048 --dtype bf16 \
        --compile off --provider ours,baseline --attention triton --fused --optimizer fused --mode train-step \
        --warmup 3 --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -28
      python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 --provider ours,baseline \
        --attention triton --fused --optimizer fused --mode train-step --profile --warmup 3 --steps 5 \
        --no-progress --results-dir "$R" > "$OUT/profile_small.log" 2>&1
      ;;
    model-sizes-compiled)
      # The same sweep compiled (each block: xl compiles in seconds) and replayed as CUDA graphs.
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --context 128,512,2048 --dtype bf16 \
        --compile ${MODEL_COMPILE:-on,reduce-overhead} --compile-scope block --provider ours,baseline \
        --attention triton --fused --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress \
        --results-dir "$R" 2>&1 | tail -52
      ;;
    model-sizes-inductor)
      # Issue 32: whether inductor's own kernels for RMSNorm, the SwiGLU gate and RoPE beat our operators under
      # torch.compile (ours compiled is slower than ours eager at every size: the operators' Python dispatch).
      # Ours with and without --fused, compiled per block and as CUDA graphs, the baseline beside them.
      for fused in --fused ""; do
        python3 -m cs336_systems.bench model --preset small,medium,large,xl --context 128,512,2048 --dtype bf16 \
          --compile on,reduce-overhead --compile-scope block --provider ours,baseline --attention triton $fused \
          --optimizer fused --mode train-step --warmup 3 --steps 8 --no-progress --results-dir "$R" 2>&1 | tail -26
      done
      ;;
    tests-split)
      # The split dV and dK passes of d 256 (16-bit) on the GPU: the reference checks at wide heads, the launch
      # plans that capture the two passes, the spill/wgmma checks. Then `attention-d256` times them.
      CS336_AUTOTUNE=0 python3 -m pytest -q -n 8 -rfE -p no:cacheprovider tests/test_kernels_flash_attention.py \
        tests/test_kernels_flash_launch_plan.py -k "split or wide or 256 or precompile" 2>&1 | tail -15
      ;;
    attention-d256)
      # Issue 35's d 256 target: fwd+bwd at d 256 at most 2.5x the d 128 time at the same shape (wide-head tiles).
      timeout "${ATTN_D256_TIMEOUT:-400}" python3 -m cs336_systems.bench attention --sweep custom --batch 1 --heads 1 \
        --seq 16384,65536,131072 \
        --d 128,256 --dtype bf16 --provider triton,sdpa-flash --pass fwd,bwd,fwd-bwd --rep-ms 200 --no-progress \
        --results-dir "$R" 2>&1 | tail -20
      ;;
    host-profile)
      # Issue 32: where the host time of a small step goes (cProfile over timed steps), ours against the baseline
      # and ours without one piece at a time, eager and compiled per block; one text file per configuration.
      python3 scripts/step_host_profile.py --preset small --context 512 --compile off,on --steps 20 \
        --out "$R/host_profile" 2>&1 | tail -14
      ;;
    model-sizes-profile)
      # Where ours loses when compiled: one profile each of ours eager and compiled (block) at small/512.
      python3 -m cs336_systems.bench model --preset small --context 512 --dtype bf16 --provider ours,baseline \
        --compile off,on --compile-scope block --attention triton --fused --optimizer fused --mode train-step \
        --profile --warmup 3 --steps 5 --no-progress --results-dir "$R" > "$OUT/profile_compiled.log" 2>&1
      grep -A3 "^| preset" "$OUT/profile_compiled.log" | head -12
      ;;
    report-gpu)
      # Issue 34: the handout's single-GPU measurements the report answers from, one run per table (~8 min).
      # benchmarking_script (b) and benchmarking_mixed_precision (c): every size, fp32 and bf16, 5 warm-up and 10
      # timed steps, ours (reference model) beside the baseline.
      python3 -m cs336_systems.bench model --preset small,medium,large,xl --dtype fp32,bf16 --provider ours,baseline \
        --mode forward,forward-backward,train-step --warmup 5 --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -30
      # benchmarking_script (c): 0, 1, 2 warm-up steps, each in a fresh process (cold context and caches).
      for warmup in 0 1 2; do
        python3 -m cs336_systems.bench model --preset small,xl --dtype fp32 --provider ours --mode forward,train-step \
          --warmup $warmup --steps 10 --no-progress --results-dir "$R" 2>&1 | tail -6
      done
      # benchmarking_mixed_precision (a): the toy model's dtypes under CUDA autocast, fp16 and bf16.
      run_stage precision
      # nsys_profile (a)-(e): two sizes, contexts up to the longest that fits (an out-of-memory case is a row),
      # a forward-only profile and a training step's, fp32, our reference model with named attention parts.
      python3 -m cs336_systems.bench model --preset small,medium --context 256,512,1024,2048 --dtype fp32 \
        --provider ours --mode forward,train-step --profile --warmup 3 --steps 5 --no-progress --results-dir "$R" \
        > "$OUT/profile_handout.log" 2>&1
      grep -E "^\| (small|medium) " "$OUT/profile_handout.log" | head -20
      # gradient_checkpointing (b): the group size k = 3 beside the ones measured.
      python3 -m cs336_systems.bench memory search --preset xl --context 2048 --batch 4 --steps 2 \
        --policies every-k:3 --results-dir "$R" 2>&1 | tail -4
      ;;
    profile)
      python3 -m cs336_systems.bench model --preset xl --mode train-step --dtype bf16 --profile --memory \
        --warmup 3 --steps 5 --no-progress --results-dir "$R" 2>&1 | tail -40
      ;;
    *) echo "unknown stage $1"; return 2 ;;
  esac
}

pack() { tar czf "$OUT/results.tgz" -C "$R" --exclude='*.pickle' --exclude='traces' --exclude='*.json' .; }
# Packed every 20 s as well, so a run stopped at its time limit still brings back the rows written so far.
# Its output goes nowhere and it is killed at the end: a background job holding stdout keeps a
# `| tee` pipeline (and so the device call) waiting until its time limit.
( while sleep 20; do pack; done ) >/dev/null 2>&1 &
PACKER=$!
trap 'kill $PACKER 2>/dev/null' EXIT
for stage in "$@"; do
  echo "=== stage $stage ($(date +%T))"
  run_stage "$stage"
  pack
done
echo "=== done ($(date +%T))"
