#!/usr/bin/env bash
# Two builds of pipetrain, side by side: `pipetrain train CONFIG` with each binary in
# alternating runs, steps/s over steps AB_FROM..N from the metrics file (AB_FROM default
# 20), and the per-pair ratio B / A. How each change of a round of speed work was measured (ratios of one sitting,
# as these machines are noisy).
#
#   bash benches/ab_builds.sh BIN_A BIN_B CONFIG [pairs]     (default 5 pairs)
#
# CONFIG needs at least 2 x AB_FROM steps (or AB_FROM=3 for short runs of large models);
# copy the build under test out of target/ first
# (`cp target/release/pipetrain /tmp/pt_a`), ORT_DYLIB_PATH set where the binaries
# cannot find the project's .venv.
set -euo pipefail
a=$1 b=$2 cfg=$3 pairs=${4:-5} from=${AB_FROM:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
lib=$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1* 2>/dev/null | head -1 || true)
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$lib}
metrics=$(mktemp)
trap 'rm -f "$metrics"' EXIT
rate() {
  rm -f "$metrics"
  "$1" train "$cfg" --metrics "$metrics" > /dev/null 2>&1
  python3 -c "
import json, sys
t = {r['step']: r['elapsed_s'] for r in map(json.loads, open(sys.argv[1])) if 'elapsed_s' in r}
last, first = max(t), int(sys.argv[2])
print(round((last - first) / (t[last] - t[first]), 4))" "$metrics" "$from"
}
echo "A steps/s | B steps/s | B / A"
for _ in $(seq "$pairs"); do
  ra=$(rate "$a"); rb=$(rate "$b")
  echo "$ra | $rb | $(python3 -c "print(round($rb / $ra, 3))")"
done
