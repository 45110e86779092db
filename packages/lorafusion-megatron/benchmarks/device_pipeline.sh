#!/usr/bin/env bash
# Issue 7's pipeline benchmark in one device call: the NCCL test, then bench_pipeline.py, then its report.
#
# From the repository root, in a device `run` (timeout_s 600) with carry [".whl"] (the wheels that
# ../shared/device/fetch-wheels.sh downloads: pydantic, highspy, megatron-core and their needs):
#   kind nvidia-h200-x2:  bash packages/lorafusion-megatron/benchmarks/device_pipeline.sh qwen2.5-32b
#   kind nvidia-h200-x4:  bash packages/lorafusion-megatron/benchmarks/device_pipeline.sh llama-3.1-70b
# Extra arguments go to bench_pipeline.py (e.g. --repeats 1, --baseline-kernels fused).
# NCCL_TEST=0 skips the NCCL test (a second call on a machine where it already passed).
# CHECKPOINTING (default balanced; all: every layer, as the runs up to 2026-11-23; none) sets
# runtime.activation_checkpointing of every schedule alike.
# Six files come back in $OUT: the results JSON, its markdown table and plot, the runs' traces
# (pipeline_trace.json of each, in a .tar.gz), and two logs.
# The call is planned to end within BUDGET seconds (default 550, under the device's 600): the NCCL
# test runs under a timeout, and the benchmark launches nothing it predicts to end past the budget.
set -uo pipefail

preset=${1:?"name a preset: qwen2.5-32b (2 GPUs) or llama-3.1-70b (4 GPUs)"}
shift
case $preset in
  qwen2.5-32b) stages=2 ;;
  llama-3.1-70b) stages=4 ;;
  *) echo "unknown preset $preset: use qwen2.5-32b (2 GPUs) or llama-3.1-70b (4 GPUs)" >&2; exit 2 ;;
esac
budget=${BUDGET:-550}
source packages/lorafusion-megatron/benchmarks/device_env.sh
# The GPUs of these machines are shared with others: NVLink multicast stays off (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp "wheels installed"

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || exit 2
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
if ((gpus < stages)); then
  echo "$preset runs on $stages pipeline stages, one GPU each, but $gpus GPU(s) are visible: use the kind with $stages GPUs" >&2
  exit 2
fi
# The package is on PYTHONPATH, not installed: no console script; the module runs the same CLI.
python3 -m lorafusion_megatron.cli --version || exit 2
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|b200' | tr 'A-Z' 'a-z')
name=pipeline_${preset}_het_${gpu:-gpu}x${stages}

test_status=0
if [[ ${NCCL_TEST:-1} != 0 ]]; then
  stamp "NCCL test (multigpu marker)"
  LORAFUSION_REQUIRE_GPU=1 timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider -m multigpu \
    packages/lorafusion-megatron/tests/test_pipeline_runtime.py 2>&1 | tee "$out/multigpu.log"
  test_status=${PIPESTATUS[0]}
  stamp "NCCL test exit status $test_status"
fi

# What is left of the budget, less a margin for the report and a launch's overrun (--grace-seconds).
deadline=$((budget - (SECONDS - start) - 60))
stamp "benchmark, deadline $deadline s"
python3 packages/lorafusion-megatron/benchmarks/bench_pipeline.py --preset "$preset" --stages "$stages" \
  --checkpointing "${CHECKPOINTING:-balanced}" --deadline-seconds "$deadline" --grace-seconds 40 --work "$(mktemp -d /tmp/bench-pipeline.XXXX)" \
  --out "$out/$name.json" "$@" 2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
stamp "benchmark exit status $bench_status"

# The device returns at most 8 files: the runs' traces travel as one archive.
if [[ -d $out/$name-traces ]]; then
  tar -czf "$out/$name-traces.tar.gz" -C "$out" "$name-traces" && rm -r "$out/$name-traces"
fi
if [[ -f $out/$name.json ]]; then
  python3 packages/lorafusion-megatron/benchmarks/report_pipeline.py "$out/$name.json" \
    --markdown "$out/$name.md" --plot "$out/$name.png"
fi
stamp "done: NCCL test $test_status, benchmark $bench_status"
exit $((test_status || bench_status))
