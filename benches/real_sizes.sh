#!/usr/bin/env bash
# pipetrain vs PyTorch eager at real sizes on the CPU: GPT-2 small (124M, batch 4 x 128
# tokens), a BERT-base classifier (110M, 8 x 128) and ViT-B/16 (86M, 8 x 224 x 224), SGD,
# float32, in alternating windows, each a fresh process: time to first step, steps/s and
# peak RSS of each engine, and their ratios per round; see benches/real_sizes.py for the
# method.
#
#   bash benches/real_sizes.sh [rounds] [models] [options of real_sizes.py...]
#        (default 3 rounds of gpt2,bert,vit; on 2 cores about 4 min a round after the
#        exports, which take about 2 min once)
#
# Scratch: $PIPETRAIN_SCRATCH (default ~/.cache/pipetrain-real-sizes): the exported models
# (about 1.2 GB of ONNX plus as much of initial weights), their data and configs, the
# results as JSON; never the repository.
# PyTorch side: TORCH_PYTHON, a Python with the packages of tools/fixtures/requirements.txt
# (transformers 4.46 works as well); by default a venv made once under the scratch from
# PyPI (torch's CUDA wheels included: several GB).
# pipetrain: target/release/pipetrain, built here; PIPETRAIN_BIN=PATH uses that executable
# instead and skips the build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-3}
models=${2:-gpt2,bert,vit}
shift $(( $# < 2 ? $# : 2 ))
export PIPETRAIN_SCRATCH=${PIPETRAIN_SCRATCH:-$HOME/.cache/pipetrain-real-sizes}
mkdir -p "$PIPETRAIN_SCRATCH"
if [ -z "${TORCH_PYTHON:-}" ]; then
  venv=$PIPETRAIN_SCRATCH/torch-venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$root/tools/fixtures/requirements.txt"
  TORCH_PYTHON=$venv/bin/python
fi
bash "$root/scripts/setup.sh" > /dev/null
if [ -n "${PIPETRAIN_BIN:-}" ]; then
  bin=$PIPETRAIN_BIN
else
  cargo build --release --features cli --manifest-path "$root/Cargo.toml" -q
  bin=$root/target/release/pipetrain
fi
"$TORCH_PYTHON" "$root/benches/real_sizes.py" --rounds "$rounds" --models "$models" \
  --bin "$bin" --scratch "$PIPETRAIN_SCRATCH" "$@"
