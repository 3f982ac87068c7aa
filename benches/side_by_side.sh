#!/usr/bin/env bash
# Training steps/s of `pipetrain train` against the peers (ONNX Runtime's training build,
# PyTorch eager), alternating windows so the ratios mean something on a noisy VM; see
# benches/side_by_side.py for the method.
#
#   bash benches/side_by_side.sh [rounds] [cases]   (default 10 rounds of
#        mlp:sgd,mlp:adamw,tiny_gpt:sgd,tiny_gpt:adamw; ~10 min after set-up)
#
# Cases bert:sgd, distilbert:sgd, vit:sgd and convnext:sgd run exported Hugging Face and
# torchvision models against PyTorch eager and ORT training instead
# (benches/exported_side_by_side.sh, with its own PyTorch environment as well).
#
# Set-up (first run only, ~5 GB, needs PyPI): the peers' venv from
# tools/peers/requirements-lock.txt and their ORT training artifacts, under
# $PEERS_SCRATCH (default ~/.cache/pipetrain-peers). The peers' scripts run from
# tools/peers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-10}
cases=${2:-mlp:sgd,mlp:adamw,tiny_gpt:sgd,tiny_gpt:adamw}
export PEERS_SCRATCH=${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}
# The exported fixtures' cases go to their own bench; the rest to the peers'.
exported=$(tr ',' '\n' <<< "$cases" | sed -n 's/^\(bert\|distilbert\|vit\|convnext\):sgd$/\1/p' | paste -sd, -)
cases=$(tr ',' '\n' <<< "$cases" | grep -Ev '^(bert|distilbert|vit|convnext):sgd$' | paste -sd, - || true)
if [ -n "$exported" ]; then
  bash "$root/benches/exported_side_by_side.sh" "$rounds" "$exported"
fi
[ -n "$cases" ] || exit 0
py=$(bash "$root/benches/peers_venv.sh")
peers=$root/tools/peers
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
if [ ! -d "$PEERS_SCRATCH/artifacts/tiny_gpt_sgd" ]; then
  (cd "$peers" && "$py" make_artifacts.py > "$PEERS_SCRATCH/artifacts.log" 2>&1)
fi
bash "$root/scripts/setup.sh" > /dev/null
cargo build --release --features cli --manifest-path "$root/Cargo.toml" -q
python3 "$root/benches/side_by_side.py" --rounds "$rounds" --cases "$cases" \
  --json "$PEERS_SCRATCH/side_by_side.json"
