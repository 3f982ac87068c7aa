#!/usr/bin/env bash
# One lent-GPU call after the payload's parts went over to /tmp/pl (benches/gpu/pack.sh
# prepares them and prints the calls): unpacks the binaries and ONNX Runtime's CUDA build,
# points them and cudarc at the machine's CUDA 13 libraries, and runs:
#   a. scripts/gpu-check.sh's kernels and GPT-2 checks (GPT2_* as below);
#   c. with LEASE_NCU=1, a GPU-side profile of pipetrain's GPT-2 step (Nsight Compute:
#      each kernel's time on the device, benches/gpu/ncu_kernels.py);
#   d. with LEASE_EAGER=1, PyTorch eager's step, timed again and profiled the same way
#      (eager_profile.py);
# (c and d ran on 2026-11-27 and are in RESULTS.md; off by default since, so that the
# GPT-2 variants not yet measured fit the call: the step replayed as a CUDA graph, the
# untried kernels, flash attention, bfloat16 against autocast.)
#   b. the checks in LEASE_REST (for example pipeline,curves,resume,precision: they need
#      peers/, which pack.sh holds back by default), if any.
#   bash benches/gpu/lease.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/gc}
mkdir -p "$out" /tmp/ort
here=$(cd "$(dirname "$0")/../.." && pwd)
if ls /tmp/pl/payload.part.* > /dev/null 2>&1; then
  (cd /tmp/pl && cat payload.part.* | tar -xf - && rm payload.part.*) || exit 1
fi
(cd /tmp/ort && xz -dc /tmp/pl/ort-*.tar.xz | tar -xf -) || exit 1
bin=${LEASE_BIN:-/tmp/pl/bin}
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
ln -sf "$NV/nccl/lib/libnccl.so.2" /tmp/ort/libnccl.so
export ORT_DYLIB_PATH=/tmp/ort/libonnxruntime.so.1.31.1
export LD_LIBRARY_PATH=/tmp/ort:$NV/cu13/lib:$NV/cudnn/lib:$NV/nccl/lib
export PIPETRAIN_GPU_CHECK_NO_BUILD=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,power.draw --format=csv,noheader
RUST_LOG=${LEASE_RUST_LOG:-warn,onnxruntime=error,pipetrain::device=debug} GPT2_PROFILE=${GPT2_PROFILE:-0} GPT2_UNORDERED=0 GPT2_HALF=${GPT2_HALF-bf16} GPT2_HOST=${GPT2_HOST:-0} GPT2_ONEHOT=${GPT2_ONEHOT:-0} \
  timeout -k 5 "${LEASE_GPT2_S:-420}" bash "$here/scripts/gpu-check.sh" --bin "$bin" --out "$out/a" \
  --checks kernels,gpt2 > "$out/a.log" 2>&1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${LEASE_NCU:-0}" = 1 ] && [ -n "$ncu" ] && [ -f "$out/a/cfg/gpt2_small.toml" ]; then
  # Six steps; skip the first ~2.7 runs (start-up and ONNX Runtime's warm-up), then one run's worth.
  sed 's/^num_train_steps = .*/num_train_steps = 6/' "$out/a/cfg/gpt2_small.toml" > "$out/gpt2_ncu.toml"
  RUST_LOG=warn timeout -k 5 "${LEASE_NCU_S:-200}" "$ncu" --clock-control none --metrics gpu__time_duration.sum \
    --csv --page raw --print-units base --launch-skip "${LEASE_NCU_SKIP:-4000}" --launch-count "${LEASE_NCU_COUNT:-1500}" \
    --log-file "$out/ncu.csv" "$bin/pipetrain" train "$out/gpt2_ncu.toml" > "$out/ncu.log" 2>&1
  python3 "$here/benches/gpu/ncu_kernels.py" "$out/ncu.csv" > "$out/ncu.txt" 2>&1
fi
[ "${LEASE_EAGER:-0}" = 0 ] \
  || timeout -k 5 "${LEASE_EAGER_S:-90}" python3 "$here/benches/gpu/eager_profile.py" > "$out/eager.txt" 2>&1
if [ -n "${LEASE_REST:-}" ]; then
  timeout -k 5 "${LEASE_REST_S:-220}" bash "$here/scripts/gpu-check.sh" --bin "$bin" --out "$out/b" \
    --checks "$LEASE_REST" > "$out/b.log" 2>&1
fi
cp "$out/a/summary.txt" "$out/a.summary.txt" 2>/dev/null
[ -f "$out/b/summary.txt" ] && cp "$out/b/summary.txt" "$out/b.summary.txt"
echo "== a"; cat "$out/a/summary.txt"; echo "== ncu"; head -30 "$out/ncu.txt" 2>/dev/null
[ -f "$out/eager.txt" ] && { echo "== eager"; head -30 "$out/eager.txt"; }
[ -f "$out/b/summary.txt" ] && { echo "== b"; cat "$out/b/summary.txt"; }
exit 0
