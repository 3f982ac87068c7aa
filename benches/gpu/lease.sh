#!/usr/bin/env bash
# One lent-GPU call after the ONNX Runtime parts went over (../shared/GPU.md): unpacks
# ONNX Runtime's CUDA build to /tmp/ort, points it and cudarc at the machine's CUDA 13
# libraries, and runs scripts/gpu-check.sh from the binaries in .gpu/bin (or LEASE_BIN),
# GPT-2 first. benches/gpu/pack.sh prepares the parts and prints the calls.
#   bash benches/gpu/lease.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/gc}
mkdir -p "$out"
(cd /tmp/ort && cat ort.part.* | xz -d | tar -xf -) || exit 1
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
ln -sf "$NV/nccl/lib/libnccl.so.2" /tmp/ort/libnccl.so
export ORT_DYLIB_PATH=/tmp/ort/libonnxruntime.so.1.31.1
export LD_LIBRARY_PATH=/tmp/ort:$NV/cu13/lib:$NV/cudnn/lib:$NV/nccl/lib
export PIPETRAIN_GPU_CHECK_NO_BUILD=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,power.draw --format=csv,noheader
RUST_LOG=${LEASE_RUST_LOG:-warn,onnxruntime=error,pipetrain::device=debug} GPT2_PROFILE=${GPT2_PROFILE:-0} GPT2_UNORDERED=0 GPT2_HALF=${GPT2_HALF:-bf16} GPT2_HOST=${GPT2_HOST:-1} GPT2_ONEHOT=${GPT2_ONEHOT:-1} \
  timeout -k 5 "${LEASE_GPT2_S:-330}" bash scripts/gpu-check.sh --bin "${LEASE_BIN:-.gpu/bin}" --out "$out/a" \
  --checks kernels,gpt2 > "$out/a.log" 2>&1
timeout -k 5 "${LEASE_REST_S:-220}" bash scripts/gpu-check.sh --bin "${LEASE_BIN:-.gpu/bin}" --out "$out/b" \
  --checks "${LEASE_REST:-pipeline,curves,resume,precision}" > "$out/b.log" 2>&1
echo "== a"; cat "$out/a/summary.txt"; echo "== b"; cat "$out/b/summary.txt"
