#!/usr/bin/env bash
# Installs what pipetrain needs beside a Rust toolchain and Python 3, idempotently:
# - ONNX Runtime's shared library, from PyPI's onnxruntime wheel, into ./.venv (where
#   pipetrain looks for it; see `pipetrain doctor`);
# - the Python packages the tests use as independent readers of pipetrain's files:
#   `onnx` (its model checker), `safetensors` (checkpoint weight files) and `tensorboard`
#   (its own event-file reader, for the TensorBoard writer's tests).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
# name==version, one per line: what the project's venv must hold.
PACKAGES="onnxruntime==1.31.1
onnx==1.19.1
safetensors==0.6.2
tensorboard==2.21.0"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
missing=$(PACKAGES="$PACKAGES" "$venv/bin/python" - <<'EOF'
import importlib.metadata as m, os
for line in os.environ["PACKAGES"].split():
    name, version = line.split("==")
    try:
        ok = m.version(name) == version
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(line)
EOF
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $missing
fi
lib=$(ls "$venv"/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n 1)
if [ -z "$lib" ]; then
  echo "setup: onnxruntime installed but libonnxruntime.so.* not found in $venv" >&2
  exit 1
fi
echo "setup: ONNX Runtime at $lib; python packages: $(echo $PACKAGES)"
