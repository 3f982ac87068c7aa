#!/usr/bin/env bash
# Train-SGD throughput of the peers (ONNX Runtime's training build, PyTorch eager) and of
# pipetrain, measured in one sitting on this machine, so the ratio means something on a
# noisy VM. Each pass runs every peer, then pipetrain's bench; pipetrain's ratios use the
# peers' figures of the same pass.
#
#   bash benches/side_by_side.sh [passes]      (default 2; ~3 min a pass after set-up)
#
# Set-up (first run only, ~5 GB, needs PyPI): the peers' venv from
# ../shared/peers/requirements-lock.txt and their ORT training artifacts, under
# $PEERS_SCRATCH (default ~/.cache/pipetrain-peers). ../shared is read-only, so the peers'
# scripts run from a copy.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
passes=${1:-2}
export PEERS_SCRATCH=${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}
peers=$PEERS_SCRATCH/peers
mkdir -p "$PEERS_SCRATCH"
rm -rf "$peers" && cp -r "$root/../shared/peers" "$peers" && chmod -R u+w "$peers"
if [ ! -x "$PEERS_SCRATCH/venv/bin/python" ]; then
  python3 -m venv "$PEERS_SCRATCH/venv"
fi
py=$PEERS_SCRATCH/venv/bin/python
"$py" -m pip install -q --disable-pip-version-check -r "$peers/requirements-lock.txt"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
if [ ! -d "$PEERS_SCRATCH/artifacts/tiny_gpt_sgd" ]; then
  (cd "$peers" && "$py" make_artifacts.py > "$PEERS_SCRATCH/artifacts.log" 2>&1)
fi
cargo bench --manifest-path "$root/Cargo.toml" --bench train_step --no-run -q 2>/dev/null
for pass in $(seq 1 "$passes"); do
  csv=$PEERS_SCRATCH/side_by_side_pass$pass.csv
  echo "model,peer,mode,opt,steps_per_s_median" > "$csv"
  echo "== pass $pass: peers"
  for model in mlp tiny_gpt; do
    for peer in ort torch; do
      line=$(cd "$peers" && "$py" bench.py --peer "$peer" --model "$model" --mode train --opt sgd 2>/dev/null | tail -n 1)
      rate=$(echo "$line" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["steps_per_s_median"])')
      echo "$model,$peer,train,sgd,$rate" >> "$csv"
      echo "  $model $peer: $rate steps/s"
    done
  done
  echo "== pass $pass: pipetrain"
  PEERS_THROUGHPUT_CSV=$csv cargo bench --manifest-path "$root/Cargo.toml" --bench train_step -q 2>/dev/null
done
