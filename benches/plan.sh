#!/usr/bin/env bash
# `pipetrain plan` against real runs: for each model, the plan's table, then its best
# MEASURE candidates, the default layout (1F1B, as many micro-batches as ranks, cuts by
# parameter count) and the fastest pipeline layout cut by time, parameters and FLOPs,
# each run for real (`--measure`) beside its predicted step. Prints each model's mean
# and largest prediction error, the measured order of the predicted top 3, the plan's
# pick against the fastest measured run, and its speed-up over the default.
#
#   bash benches/plan.sh [CONFIG...]      (default: benches/plan/*.toml and the peers' tiny GPT)
#
# Env: PIPETRAIN_BIN (target/release/pipetrain), DEVICES (2), MEASURE (8), ROUNDS (1: each
# measured run's rounds, taken in turn, their median reported), PROFILE_ROUNDS (1: the
# profile's timed runs' rounds, each size the median of its rounds); MANIFEST (a
# cluster manifest whose nodes are all on this machine, e.g. examples/cluster.toml: the
# layouts span its nodes, one `pipetrain launch` process a node, and each measured layout
# is launched so); PROFILE_CACHE_DIR (keep each model's profile there, `--profile-cache`:
# a second bench of the same models measures the layouts again without profiling again).
# Models whose step is under a few milliseconds (the tests' fixtures) get longer profiles
# and runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${PIPETRAIN_BIN:-$root/target/release/pipetrain}
: "${ORT_DYLIB_PATH:=$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so* | head -1)}"
export ORT_DYLIB_PATH
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  configs=("$root"/benches/plan/*.toml "$root"/examples/tiny_gpt_sgd.toml)
fi
for c in "${configs[@]}"; do
  steps=(--profile-steps 8 --measure-steps 12)
  case "$(basename "$c")" in
    gpt2.toml|bert.toml|vit.toml|llama.toml|tiny_gpt_sgd.toml)
      steps=(--profile-steps 40 --measure-steps 60) ;;
  esac
  echo "=== $c"
  workers=(--devices "${DEVICES:-2}")
  if [ -n "${MANIFEST:-}" ]; then
    workers=(--manifest "$MANIFEST")
  fi
  if [ -n "${PROFILE_CACHE_DIR:-}" ]; then
    mkdir -p "$PROFILE_CACHE_DIR"
    workers+=(--profile-cache "$PROFILE_CACHE_DIR/$(basename "$c" .toml).json")
  fi
  "$bin" plan "$c" "${workers[@]}" --top 5 --measure "${MEASURE:-8}" \
    --measure-rounds "${ROUNDS:-1}" --profile-rounds "${PROFILE_ROUNDS:-1}" "${steps[@]}"
done
