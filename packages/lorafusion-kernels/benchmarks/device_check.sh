#!/usr/bin/env bash
# One device call: environment, GPU tests, Triton API probe, benchmark, tuner. Writes logs/JSON to $OUT.
#   STAGES="tests tune bench" (default all, run in that order); TEST_K (a pytest -k expression),
#   TUNE_ARGS, BENCH_ARGS (passed through); *_TIMEOUT (seconds per stage).
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
if [[ " $STAGES " == *" tests "* ]]; then
  LORAFUSION_REQUIRE_GPU=1 timeout 300 python3 -m pytest ${TEST_PATHS:-packages/lorafusion-kernels/tests/test_lora_gpu.py} -m gpu -q -p no:cacheprovider --tb=short \
    ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ " $STAGES " == *" tune "* ]]; then
  timeout "${TUNE_TIMEOUT:-200}" python3 -m lorafusion_kernels.tuning --out "$OUT/configs" ${TUNE_ARGS:-} 2>&1 \
    | tee "$OUT/tune.log" | tail -30
fi
if [[ " $STAGES " == *" bench "* ]]; then
  # Benchmark with the configs just tuned, if any.
  if [[ -d "$OUT/configs" ]]; then export LORAFUSION_KERNELS_CONFIG_DIR="$OUT/configs"; fi
  timeout "${BENCH_TIMEOUT:-300}" python3 packages/lorafusion-kernels/benchmarks/bench_lora.py --out "$OUT/bench" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
