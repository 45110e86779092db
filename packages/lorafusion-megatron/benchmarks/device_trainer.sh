#!/usr/bin/env bash
# The single-GPU trainer's measurements (issue 6) in one device call each, on 1x H100.
#
# From the repository root, in a device `run` (timeout_s 600) with carry [".whl"] (the wheels that
# ../shared/device/fetch-wheels.sh downloads: pydantic, highspy and their needs):
#   STAGES=bench  bash packages/lorafusion-megatron/benchmarks/device_trainer.sh   # about 350 s
#   STAGES=auto   bash packages/lorafusion-megatron/benchmarks/device_trainer.sh   # about 250 s
# Stages:
#   bench: bench_trainer.py on the 8B preset, the fused modes and the floor at 8,192 tokens per
#          microbatch, plain PEFT at 4,096 (where it fits), then the whole trainer twice in the
#          same process (the first run pays the one-time costs) and once more under the profiler
#          (GPU busy and idle time per microbatch). BENCH_ARGS replaces the arguments.
#   auto:  `lorafusion-megatron train` on examples/llama-3.1-8b-het.yaml with `capacity: auto` and
#          a fresh output folder: the CLI profiles the model first (profile.json, profile.md), then
#          trains AUTO_STEPS steps per job at the chosen capacity (summary.json, plan.json).
#          AUTO_CHECKPOINTING=auto also sets runtime.activation_checkpointing (the profile then
#          chooses the recomputed layers too; any other value is used as given, e.g. [16]);
#          AUTO_NAME names the run's folder and log (default auto).
#   recompute: `lorafusion-megatron profile` on the same example with RECOMPUTE layers recomputed
#          (default "0 8 16 32": runtime.activation_checkpointing = [N]) at RECOMPUTE_CAPACITIES
#          tokens (default "8192 16384"): forward and backward time and peak memory per count.
# Everything worth keeping lands in $OUT: the results JSON, logs, the profile and the run summary.
set -uo pipefail

stages=${STAGES:-bench}
source packages/lorafusion-megatron/benchmarks/device_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
stamp "wheels installed"

status=0
if [[ " $stages " == *" bench "* ]]; then
  python3 packages/lorafusion-megatron/benchmarks/bench_trainer.py \
    ${BENCH_ARGS:---preset llama-3.1-8b --capacity 8192 --baseline-capacity 4096 --samples 32 --repeats 2 \
      --modes frozen peft-sequential lorafusion-siblings --trainer 2 --trainer-siblings --trainer-profile} \
    --out "$out/trainer.json" 2>&1 | tee "$out/bench.log" | tail -20
  status=$((status | PIPESTATUS[0]))
  stamp "bench done"
fi
if [[ " $stages " == *" auto "* ]]; then
  name=${AUTO_NAME:-auto}
  run="$out/$name-run"
  steps=${AUTO_STEPS:-3}
  sets=(--set scheduler.capacity=auto --set "output_dir=$run" --set logging.tensorboard_dir=null --set save_steps=null)
  if [[ -n ${AUTO_CHECKPOINTING:-} ]]; then sets+=(--set "runtime.activation_checkpointing=$AUTO_CHECKPOINTING"); fi
  for job in 0 1 2 3; do sets+=(--set "jobs.$job.max_steps=$steps"); done
  python3 -m lorafusion_megatron.cli train packages/lorafusion-megatron/examples/llama-3.1-8b-het.yaml "${sets[@]}" \
    2>&1 | tee "$out/$name.log" | tail -40
  status=$((status | PIPESTATUS[0]))
  # Keep the small files; the adapters (about 170 MB each) stay behind.
  rm -rf "$run/adapters" "$run/checkpoints"
  stamp "$name done"
fi
if [[ " $stages " == *" recompute "* ]]; then
  for count in ${RECOMPUTE:-0 8 16 32}; do
    run="$out/recompute-$count"
    python3 -m lorafusion_megatron.cli profile packages/lorafusion-megatron/examples/llama-3.1-8b-het.yaml \
      --set "output_dir=$run" --set logging.tensorboard_dir=null --set "runtime.activation_checkpointing=[$count]" \
      --capacities ${RECOMPUTE_CAPACITIES:-8192 16384} 2>&1 | tee "$out/recompute-$count.log" | tail -25
    status=$((status | PIPESTATUS[0]))
    stamp "recompute $count done"
  done
fi
exit $status
