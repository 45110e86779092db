#!/usr/bin/env bash
# One device call: environment, GPU tests, Triton API probe, benchmark, tuner. Writes logs/JSON to $OUT.
#   STAGES="tests tune bench" (the default, run in that order; "repro" tunes one subset twice and
#   compares the runs; "multi" adds the FusedMultiLoRA benchmarks: bench_multi_lora.py, then
#   bench_grouped.py); TEST_PATHS and TEST_K (pytest paths and -k expression), TUNE_ARGS, REPRO_ARGS,
#   BENCH_ARGS, MULTI_ARGS, GROUPED_ARGS (passed through); *_TIMEOUT (seconds per stage);
#   EXPECT_GPU (e.g. H200: stop after the environment report when the GPU's name lacks it, so a call
#   meant to tune one GPU's file spends nothing on another GPU).
# A device call ends after 600 s: run the tune stage alone (STAGES=tune). By default it tunes the
# FusedMultiLoRA kernels (multi_*) on LLaMa-3.1-8B's layers, M = 4K and 8K, r = 16, merged into
# this GPU's shipped file: $OUT/configs/<gpu-key>.json is the file to commit. The tuner starts no
# new shape after TUNE_LIMIT seconds (default 400) and prints each winner, the time of the config
# the kernel launches with now, and the elapsed time.
# Run from the repository root; the package is used from source (PYTHONPATH), not installed.
set -uo pipefail
export PYTHONPATH="$PWD/packages/lorafusion-kernels/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/lorafusion-out}"
mkdir -p "$OUT"
STAGES="${STAGES:-tests tune bench}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 - <<'PY'
import importlib, torch, triton, triton.language as tl
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
for mod in ("peft", "transformers"):
    try:
        print(mod, importlib.import_module(mod).__version__)
    except ImportError as exc:
        print(mod, "missing", exc)
print("capability", torch.cuda.get_device_capability(), "sms", torch.cuda.get_device_properties(0).multi_processor_count)
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
    print("TensorDescriptor ok", TensorDescriptor)
except ImportError as exc:
    print("TensorDescriptor missing", exc)
print("make_tensor_descriptor", hasattr(tl, "make_tensor_descriptor"), "interleave", hasattr(tl, "interleave"))
PY
} 2>&1 | tee "$OUT/env.txt"
if [[ -n "${EXPECT_GPU:-}" ]] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$EXPECT_GPU"; then
  echo "EXPECT_GPU=$EXPECT_GPU: this GPU is not one; nothing run" | tee -a "$OUT/env.txt"
  exit 3
fi
if [[ " $STAGES " == *" tests "* ]]; then
  LORAFUSION_REQUIRE_GPU=1 timeout 300 python3 -m pytest ${TEST_PATHS:-packages/lorafusion-kernels/tests/test_lora_gpu.py} -m gpu -q -p no:cacheprovider --tb=short \
    ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ " $STAGES " == *" tune "* ]]; then
  key=$(python3 -c "import torch; from lorafusion_kernels.tuning import gpu_key; print(gpu_key(torch.cuda.get_device_name()))")
  shipped="packages/lorafusion-kernels/src/lorafusion_kernels/configs/$key.json"
  multi="multi_xa multi_xw_sb multi_dys_dyb multi_dsx multi_dsx_dx multi_dyw_dsa"
  started=$SECONDS
  timeout "${TUNE_TIMEOUT:-540}" python3 -m lorafusion_kernels.tuning --out "$OUT/configs" \
    ${TUNE_ARGS:---models llama-3.1-8b --m 4096 8192 --r 16 --kernels $multi --time-limit ${TUNE_LIMIT:-400} --merge $shipped} \
    2>&1 | tee "$OUT/tune.log" | tail -60
  echo "tune stage: $((SECONDS - started)) s" | tee -a "$OUT/tune.log"
fi
if [[ " $STAGES " == *" repro "* ]]; then
  # Two tuning runs of one subset, back to back, each keeping every candidate's time; then how far
  # they agree (winners, and the regret: how much slower each run timed the other's winner).
  key=$(python3 -c "import torch; from lorafusion_kernels.tuning import gpu_key; print(gpu_key(torch.cuda.get_device_name()))")
  for run in a b; do
    timeout "${REPRO_TIMEOUT:-240}" python3 -m lorafusion_kernels.tuning --out "$OUT/repro-$run" \
      --timings "$OUT/repro-$run/timings.json" \
      ${REPRO_ARGS:---models llama-3.1-8b llama-3.1-70b --m 8192 --r 16 --kernels xw_sb dyw_dsa multi_xw_sb multi_dyw_dsa --rep 50} \
      2>&1 | tee "$OUT/repro-$run.log" | tail -5
  done
  { python3 -m lorafusion_kernels.tuning --compare "$OUT/repro-a/timings.json" "$OUT/repro-b/timings.json"
    python3 -m lorafusion_kernels.tuning --compare "$OUT/repro-a/$key.json" "$OUT/repro-b/$key.json"
  } 2>&1 | tee "$OUT/repro.txt"
fi
if [[ " $STAGES " == *" bench "* ]]; then
  # Benchmark with the configs just tuned, if any.
  if [[ -d "$OUT/configs" ]]; then export LORAFUSION_KERNELS_CONFIG_DIR="$OUT/configs"; fi
  timeout "${BENCH_TIMEOUT:-300}" python3 packages/lorafusion-kernels/benchmarks/bench_lora.py --out "$OUT/bench" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [[ " $STAGES " == *" multi "* ]]; then
  timeout "${MULTI_TIMEOUT:-300}" python3 packages/lorafusion-kernels/benchmarks/bench_multi_lora.py --out "$OUT/bench" \
    ${MULTI_ARGS:---layers llama8b --m 4096 8192 --adapters 1 4 --rep 40} 2>&1 | tee "$OUT/multi.log" | tail -40
  timeout "${GROUPED_TIMEOUT:-200}" python3 packages/lorafusion-kernels/benchmarks/bench_grouped.py --out "$OUT/bench" \
    ${GROUPED_ARGS:-} 2>&1 | tee "$OUT/grouped.log" | tail -30
fi
