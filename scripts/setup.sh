#!/usr/bin/env bash
# Installs what pipetrain needs beside a Rust toolchain and Python 3, idempotently:
# ONNX Runtime's shared library, from PyPI's onnxruntime wheel, into ./.venv (where
# pipetrain looks for it; see `pipetrain doctor`).
set -euo pipefail
cd "$(dirname "$0")/.."
ORT_VERSION=1.31.1
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('onnxruntime') != '$ORT_VERSION')" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "onnxruntime==$ORT_VERSION"
fi
lib=$(ls "$venv"/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n 1)
if [ -z "$lib" ]; then
  echo "setup: onnxruntime $ORT_VERSION installed but libonnxruntime.so.* not found in $venv" >&2
  exit 1
fi
echo "setup: ONNX Runtime $ORT_VERSION at $lib"
