#!/usr/bin/env bash
# The optimizer state sharded across data-parallel replicas (deepspeed_zero_stage = 1),
# measured: GPT-2 small (124 M, 4 x 128 tokens a micro-batch, AdamW) at dp = 2 x pp = 2,
# four `pipetrain launch` processes on loopback: unsharded with gradient buckets (the
# default), unsharded without them (as stage-1 runs reduce), sharded (stage 1), then
# the gradients sharded too (stage 2, in buckets); RUNS picks some of
# "buckets whole sharded sharded2". Prints each
# rank's predicted and measured peak memory, what its optimizer keeps, and whether the
# runs' losses are the same bits.
#
#   bash benches/zero.sh
#
# Needs GPT-2 small exported by benches/real_sizes.sh (REAL_SIZES_DIR, default
# ~/.cache/pipetrain-real-sizes). Env: PIPETRAIN_BIN (target/release/pipetrain), STEPS (3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${PIPETRAIN_BIN:-$root/target/release/pipetrain}
dir=${REAL_SIZES_DIR:-$HOME/.cache/pipetrain-real-sizes}/gpt2
steps=${STEPS:-3}
[ -f "$dir/model.onnx" ] || { echo "no $dir/model.onnx: run benches/real_sizes.sh first" >&2; exit 2; }
: "${ORT_DYLIB_PATH:=$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so* | head -1)}"
export ORT_DYLIB_PATH
export RUST_LOG=${RUST_LOG:-info,onnxruntime=error}
work=$(mktemp -d)
trap 'cp -r "$work" /tmp/zero_last 2>/dev/null; rm -rf "$work"' EXIT

config() { # config ZERO_STAGE BUCKET_MB
  cat <<EOF
model_path = "$dir/model.onnx"
batch_size = 2
gradient_accumulation_steps = 2
num_train_steps = $((steps * 2))
data_parallel_size = 2
pipeline_parallel_size = 2
display_loss_steps = 1
deepspeed_zero_stage = $1
gradient_bucket_mb = $2
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "labels"
[data]
path = "$dir/data.npz"
layout = { kind = "arrays", feeds = { input_ids = "input_ids", labels = "labels" } }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-4
[runtime]
intra_op_threads = 1
EOF
}

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/cluster.secret"
chmod 600 "$work/cluster.secret"
run() { # run NAME ZERO_STAGE BUCKET_MB
  local z=$1 port=$((20000 + RANDOM % 20000))
  config "$2" "$3" > "$work/z$z.toml"
  cat > "$work/manifest$z.toml" <<EOF
[job]
name = "zero"
secret_file = "cluster.secret"
rendezvous = "127.0.0.1:$port"
heartbeat_ms = 500
max_restarts = 0
peer_timeout_s = 300
connect_timeout_s = 300
[layout]
data_parallel = 2
pipeline_parallel = 2
EOF
  for i in 0 1 2 3; do
    printf '[[nodes]]\nname = "n%d"\naddress = "127.0.0.%d"\nport = %d\ncpu_slots = 1\n' \
      "$i" $((i + 1)) $((port + 1)) >> "$work/manifest$z.toml"
  done
  local pids=() fail=0 start
  start=$(date +%s)
  for i in 0 1 2 3; do
    "$bin" launch --manifest "$work/manifest$z.toml" --node "n$i" \
      --metrics "$work/z$z.jsonl" "$work/z$z.toml" > "$work/z$z-n$i.out" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2 3; do wait "${pids[$i]}" || fail=1; done
  echo "== deepspeed_zero_stage = $2, gradient_bucket_mb = $3: wall $(( $(date +%s) - start )) s"
  for i in 0 1 2 3; do
    keeps=$(grep -ho "data-parallel rank [0-9]* keeps the optimizer state of [0-9]* of its [0-9]*" "$work/z$z-n$i.out" | head -1 || true)
    peak=$(grep -ho "peak memory of this process: .*" "$work/z$z-n$i.out" | tail -1 || true)
    echo "node $i: ${peak:-no peak line}${keeps:+; $keeps}"
  done
  [ "$fail" -eq 0 ] || { for i in 0 1 2 3; do tail -3 "$work/z$z-n$i.out"; done; exit 1; }
}
names=(${RUNS:-buckets whole sharded sharded2})
for name in "${names[@]}"; do
  case $name in
    buckets) run buckets 0 25 ;;
    whole) run whole 0 0 ;;
    sharded) run sharded 1 0 ;;
    sharded2) run sharded2 2 25 ;;
  esac
done
python3 - "${names[@]/#/$work/z}" <<'PY'
import json, sys
runs = {p.rsplit("/z", 1)[1]: [json.loads(l)["loss"] for l in open(p + ".jsonl") if "loss" in l]
        for p in sys.argv[1:]}
for name, losses in runs.items():
    print(f"losses {name:8} {losses}")
first = next(iter(runs.values()))
exact = [n for n, r in runs.items() if n != "sharded2"]
print(f"the same bits (stage 2 aside): {all(runs[n] == runs[exact[0]] for n in exact)}")
if "sharded2" in runs:
    off = max(abs(a - b) for a, b in zip(runs["sharded2"], first))
    print(f"stage 2 (the replicas summed per micro-batch) within {off:.3g} of {next(iter(runs))}")
PY
