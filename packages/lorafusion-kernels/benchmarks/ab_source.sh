#!/usr/bin/env bash
# A kernel-code change timed against the code before it, on one GPU in one device call.
#   ab_source.sh BEFORE_SRC [ROUNDS]
# BEFORE_SRC is a copy of the package's src/ before the change, e.g. after
# `mkdir ab-before && git archive HEAD~1 packages/lorafusion-kernels/src | tar -x -C ab-before`
# it is ab-before/packages/lorafusion-kernels/src (untracked, so the device tool carries it).
# Runs bench_multi_lora.py ROUNDS times (default 2) per tree, alternating before/after so that a
# drift of the GPU's clock hits both alike, then bench_grouped.py (the sibling calls) once per tree
# (GROUPED=0 skips it). MULTI_ARGS overrides the bench_multi_lora.py grid.
# Results: $OUT/bench/<gpu-key>-multi-{before,after}-<round>.json (compare the rows' fwd_bwd_graph_ms)
# and $OUT/bench-grouped-{before,after}/<gpu-key>-grouped.json. Exits 1 if any run failed.
# Run from the repository root.
set -uo pipefail
before="$1"
rounds="${2:-2}"
after="$PWD/packages/lorafusion-kernels/src"
OUT="${OUT:-/tmp/lorafusion-out}"
mkdir -p "$OUT/bench"
bench="packages/lorafusion-kernels/benchmarks"
args="${MULTI_ARGS:---layers llama8b --m 8192 --adapters 1 4 --distributions even --providers frozen fused_multi --rep 40}"
status=0
source_of() { [[ $1 == before ]] && echo "$before" || echo "$after"; }
for ((i = 1; i <= rounds; i++)); do
  for side in before after; do
    echo "== round $i: $side"
    # shellcheck disable=SC2086  # the arguments are meant to split
    PYTHONPATH="$(source_of $side)" timeout 240 python3 "$bench/bench_multi_lora.py" --out "$OUT/bench" \
      --tag="-$side-$i" $args 2>&1 | tail -12 || { echo "== round $i: $side FAILED"; status=1; }
  done
done
if [[ "${GROUPED:-1}" != 0 ]]; then
  for side in before after; do
    echo "== grouped: $side"
    PYTHONPATH="$(source_of $side)" timeout 200 python3 "$bench/bench_grouped.py" --out "$OUT/bench-grouped-$side" \
      2>&1 | tail -12 || { echo "== grouped: $side FAILED"; status=1; }
  done
fi
exit $status
