#!/usr/bin/env bash
# pipetrain vs PyTorch eager and ONNX Runtime's training build on exported Hugging Face
# and torchvision models (BERT, DistilBERT, ViT, ConvNeXt), in alternating windows; see
# benches/exported_side_by_side.py for the method.
#
#   bash benches/exported_side_by_side.sh [rounds] [families] [threads]
#        (default 10 rounds of bert,distilbert,vit,convnext, 2 threads each; ~25 min
#        after set-up)
#
# ORT side: the peers' venv (benches/peers_venv.sh).
# PyTorch side: TORCH_PYTHON, a Python with the packages of tools/fixtures/requirements.txt;
# by default a venv made once under $PEERS_SCRATCH (default ~/.cache/pipetrain-peers) from
# PyPI (torch's CUDA wheels included: several GB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-10}
families=${2:-bert,distilbert,vit,convnext}
threads=${3:-2}
export PEERS_SCRATCH=${PEERS_SCRATCH:-$HOME/.cache/pipetrain-peers}
if [ -z "${TORCH_PYTHON:-}" ]; then
  venv=$PEERS_SCRATCH/torch-venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$root/tools/fixtures/requirements.txt"
  TORCH_PYTHON=$venv/bin/python
fi
export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
bash "$root/scripts/setup.sh" > /dev/null
cargo build --release --features cli --manifest-path "$root/Cargo.toml" -q
ort=(--ort-python "$(bash "$root/benches/peers_venv.sh")")
"$TORCH_PYTHON" "$root/benches/exported_side_by_side.py" --rounds "$rounds" \
  --families "$families" --threads "$threads" "${ort[@]}"
