#!/usr/bin/env bash
# The CPU's large products on OpenBLAS's Haswell kernels, on ONNX Runtime's MLAS and on
# OpenBLAS's Skylake-X kernels, in turn each round: steps/s of `pipetrain train CONFIG`
# over steps 4..N (`compute/blas/core.rs`: on a CPU with AVX-512, pipetrain declines an
# OpenBLAS whose kernels leave it unused).
#
#   bash benches/blas_kernels.sh [CONFIG] [rounds]   (default benches/blas_kernels.toml, 3)
#
# Each variant names the library explicitly (`PIPETRAIN_BLAS`), so pipetrain's own choice
# does not enter. Skylake-X's kernels need a CPU with AVX-512.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cfg=${1:-$root/benches/blas_kernels.toml} rounds=${2:-3}
pt=${PIPETRAIN:-$root/target/release/pipetrain}
lib=$(ls "$root"/.venv/lib/python3*/site-packages/scipy_openblas32/lib/libscipy_openblas.so)
metrics=$(mktemp)
trap 'rm -f "$metrics"' EXIT
rate() {
  rm -f "$metrics"
  env "$@" "$pt" train "$cfg" --metrics "$metrics" > /dev/null 2>&1
  python3 -c "
import json, sys
t = {r['step']: r['elapsed_s'] for r in map(json.loads, open(sys.argv[1])) if 'elapsed_s' in r}
last, first = max(t), 4
print(round((last - first) / (t[last] - t[first]), 4))" "$metrics"
}
echo "steps/s: OpenBLAS Haswell | MLAS | OpenBLAS SkylakeX"
for _ in $(seq "$rounds"); do
  a=$(rate PIPETRAIN_BLAS="$lib" OPENBLAS_CORETYPE=Haswell)
  b=$(rate PIPETRAIN_BLAS=off)
  c=$(rate PIPETRAIN_BLAS="$lib" OPENBLAS_CORETYPE=SkylakeX)
  echo "$a | $b | $c"
done
