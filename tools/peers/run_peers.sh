#!/usr/bin/env bash
# Reproduce the peer baselines from scratch (CPU only).
#
#   bash run_peers.sh            # everything: venv, data, ONNX, artifacts, curves, bench, summary
#   bash run_peers.sh data       # only the venv + data/ (weights, data sets, ONNX forward models)
#   bash run_peers.sh curves     # venv + data + artifacts + reference loss curves
#   bash run_peers.sh bench      # venv + data + artifacts + throughput/RSS + summary
#
# Writes the repository's peers/data and peers/results (what the tests and examples read;
# CI does not run this). Scratch (venv, pip cache, training artifacts) goes to
# $PEERS_SCRATCH (default ~/.cache/pipetrain-peers).
# Needs python3.11 and PyPI access; the default torch wheel pulls ~3 GB of CUDA
# libraries that are not used (CPU only).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PEERS_SCRATCH="${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}"
PYTHON="${PYTHON:-python3}"
VENV="$PEERS_SCRATCH/venv"
WHAT="${1:-all}"

mkdir -p "$PEERS_SCRATCH"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$HERE/requirements-lock.txt"
PY="$VENV/bin/python"
cd "$HERE"

# keep BLAS/OpenMP pools at the 2 threads the benchmarks use
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2

# run a step, hide the exporters' warning noise, fail loudly on error
quiet() {
  local log="$PEERS_SCRATCH/last_step.log"
  if ! "$@" > "$log" 2>&1; then cat "$log"; echo "FAILED: $*" >&2; exit 1; fi
  grep -v -i -E "warn|^\s*$|\[I:onnxruntime|^\s+att = " "$log" || true
}

echo "== data: initial weights (.npz/.safetensors), data sets (.npz)"
quiet "$PY" gen_data.py
echo "== data: ONNX forward models (opset 17)"
quiet "$PY" export_onnx.py
if [ -f ../../peers/data/SHA256SUMS ]; then
  (cd ../../peers/data && sha256sum -c SHA256SUMS)
fi
[ "$WHAT" = data ] && exit 0

echo "== ORT training artifacts -> $PEERS_SCRATCH/artifacts"
quiet "$PY" make_artifacts.py

if [ "$WHAT" = all ] || [ "$WHAT" = curves ]; then
  echo "== reference loss curves (200 steps x {sgd,adamw} x {mlp,tiny_gpt})"
  quiet "$PY" curves.py
fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  echo "== throughput + peak RSS"
  "$PY" bench_all.py
  "$PY" summarize.py
fi
