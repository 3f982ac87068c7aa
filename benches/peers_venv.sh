#!/usr/bin/env bash
# Makes (once) the peers' Python environment, ../shared/peers/requirements-lock.txt
# (onnxruntime-training-cpu 1.19.2, torch 2.5.1) in $PEERS_SCRATCH/venv, with a writable
# copy of ../shared/peers in $PEERS_SCRATCH/peers; prints the Python's path. Sourced by
# the side-by-side benches; needs PyPI the first time (~5 GB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}
peers=$scratch/peers
mkdir -p "$scratch"
rm -rf "$peers" && cp -r "$root/../shared/peers" "$peers" && chmod -R u+w "$peers"
if [ ! -x "$scratch/venv/bin/python" ]; then
  python3 -m venv "$scratch/venv" >&2
fi
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check \
  -r "$peers/requirements-lock.txt" >&2
echo "$scratch/venv/bin/python"
