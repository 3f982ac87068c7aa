#!/usr/bin/env bash
# Makes (once) the peers' Python environment, tools/peers/requirements-lock.txt
# (onnxruntime-training-cpu 1.19.2, torch 2.5.1), in $PEERS_SCRATCH/venv; prints the
# Python's path. The peers' scripts run from tools/peers and read peers/data. Sourced by
# the side-by-side benches; needs PyPI the first time (~5 GB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}
mkdir -p "$scratch"
if [ ! -x "$scratch/venv/bin/python" ]; then
  python3 -m venv "$scratch/venv" >&2
fi
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check \
  -r "$root/tools/peers/requirements-lock.txt" >&2
echo "$scratch/venv/bin/python"
