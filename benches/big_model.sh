#!/usr/bin/env bash
# A model too big for one capped process, trained by a pipeline of four.
#
#   bash benches/big_model.sh [CAP_GB]      (default 6; needs root for memory cgroups)
#
# 1. Exports a Llama-shaped model of 953 M parameters (benches/big_model.py; ~1 min and
#    3.8 GB of external data, reused while its recipe holds).
# 2. pp = 1, AdamW, in a memory cgroup of CAP_GB: pipetrain must refuse it before step
#    1, saying the predicted peak, the cap and what would fit.
# 3. pp = 4: four `pipetrain launch` processes on loopback, each in its own cgroup of
#    CAP_GB, train 2 AdamW steps of 4 x 64 tokens. Prints each rank's predicted
#    and measured peak, the cgroups' own peaks (memory.max_usage_in_bytes: what the
#    kernel charged, page cache included) and OOM kills, and the losses.
#
# Env: PYTHON (default /work/venv-fixtures/bin/python, else python3), PIPETRAIN_BIN
# (default target/release/pipetrain), BIG_MODEL_DIR (~/.cache/pipetrain-big-model),
# STEPS (2), MICRO (micro-batches a step, 4), REFERENCE (1: then also pp = 1 without
# a cap, ~16 GB, whose losses the pipeline's must equal), REFUSE (1: step 2).
# The layout of step 3: DP (1) x PP (4) launched processes, ZERO (0; 1 shards the
# optimizer state across the DP replicas), OPTIMIZER ("adamw"; "sgd" is SGD with
# momentum 0.9), PARTITION (a `partition = ...` line for the launched layout's
# `[pipeline]` table). The sharded run that fits this 24 GB machine (AdamW's would need
# ~25 GB): DP=2 PP=2 ZERO=1 OPTIMIZER=sgd REFUSE=0 \
#   PARTITION='partition = { balanced = { stages = 2, by = "params" } }' \
#   bash benches/big_model.sh 6
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cap_gb=${1:-6}
cap=$(python3 -c "print(int($cap_gb * 1e9))")
py=${PYTHON:-/work/venv-fixtures/bin/python}
[ -x "$py" ] || py=python3
bin=${PIPETRAIN_BIN:-$root/target/release/pipetrain}
dir=${BIG_MODEL_DIR:-$HOME/.cache/pipetrain-big-model}
steps=${STEPS:-2}
dp=${DP:-1}
pp=${PP:-4}
zero=${ZERO:-0}
optimizer=${OPTIMIZER:-adamw}
# A step of 4 rows of 64 tokens, in MICRO micro-batches (over all replicas).
micro=${MICRO:-4}
batch=$((4 / micro))
: "${ORT_DYLIB_PATH:=$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so* | head -1)}"
export ORT_DYLIB_PATH
# The phases' times and peaks, and the prediction by part, in each process's log.
export RUST_LOG=${RUST_LOG:-info,onnxruntime=error}
cgroups=/sys/fs/cgroup/memory
[ -w "$cgroups" ] || { echo "needs cgroup v1's memory controller, writable (root)" >&2; exit 2; }

"$py" "$root/benches/big_model.py" "$dir" | grep -E '"parameters"|total_bytes|export_s'
work=$(mktemp -d)
trap 'cp -r "$work" /tmp/big_last 2>/dev/null; rm -rf "$work"; for g in "$cgroups"/pipetrain-big-*; do [ -d "$g" ] && rmdir "$g" 2>/dev/null; done; true' EXIT

config() { # config PP [DP ZERO] > file
  local d=${2:-1}
  cat <<EOF
pipeline_parallel_size = $1
data_parallel_size = $d
deepspeed_zero_stage = ${3:-0}
model_path = "$dir/model.onnx"
batch_size = $batch
gradient_accumulation_steps = $((micro / d))
num_train_steps = $((steps * micro / d))
display_loss_steps = 1
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "labels"
[data]
path = "$dir/data.npz"
layout = { kind = "arrays", feeds = { input_ids = "input_ids", labels = "labels" } }
[optimizer]
$(case $optimizer in sgd) printf 'kind = "sgd"\nmomentum = 0.9' ;; *) echo "kind = \"$optimizer\"" ;; esac)
[lr_schedule]
kind = "constant"
lr = 1e-4
[pipeline]
$( [ "$1" -gt 1 ] && printf '%b' "${PARTITION:-}")
EOF
}

cgroup() { # cgroup NAME: a fresh memory cgroup of the cap; prints its path
  local g=$cgroups/pipetrain-big-$1
  [ -d "$g" ] && rmdir "$g"
  mkdir "$g"
  echo "$cap" > "$g/memory.limit_in_bytes"
  echo "$g"
}

in_cgroup() { # in_cgroup DIR CMD...: runs CMD inside cgroup DIR
  local g=$1; shift
  bash -c 'echo $$ > "$0/cgroup.procs"; exec "$@"' "$g" "$@"
}

oom_kills() { awk '/^oom_kill /{print $2}' "$1/memory.oom_control"; }

if [ "${REFUSE:-1}" = 1 ]; then
echo "== pp = 1 under a ${cap_gb} GB cgroup: must be refused before step 1"
config 1 > "$work/pp1.toml"
g=$(cgroup one)
set +e
in_cgroup "$g" "$bin" train "$work/pp1.toml" > "$work/pp1.out" 2>&1
rc=$?
set -e
grep -E "^error" "$work/pp1.out" || tail -5 "$work/pp1.out"
echo "exit $rc; cgroup peak $(( $(cat "$g/memory.max_usage_in_bytes") / 1000000 )) MB, OOM kills $(oom_kills "$g")"
[ "$rc" -ne 0 ] || { echo "pp = 1 was not refused" >&2; exit 1; }
fi

ranks=$((dp * pp))
echo "== dp = $dp x pp = $pp (deepspeed_zero_stage = $zero, $optimizer): $ranks launched ranks, each under a ${cap_gb} GB cgroup"
config "$pp" "$dp" "$zero" > "$work/pp4.toml"
port=$((20000 + RANDOM % 20000))
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/cluster.secret"
chmod 600 "$work/cluster.secret"
cat > "$work/manifest.toml" <<EOF
[job]
name = "big"
secret_file = "cluster.secret"
rendezvous = "127.0.0.1:$port"
heartbeat_ms = 500
max_restarts = 0
peer_timeout_s = 120
connect_timeout_s = 120
[layout]
data_parallel = $dp
pipeline_parallel = $pp
EOF
for i in $(seq 0 $((ranks - 1))); do
  printf '[[nodes]]\nname = "n%d"\naddress = "127.0.0.%d"\nport = %d\ncpu_slots = 1\n' \
    "$i" $((i + 1)) $((port + 1)) >> "$work/manifest.toml"
done
start=$(date +%s)
pids=()
for i in $(seq 0 $((ranks - 1))); do
  g=$(cgroup "n$i")
  in_cgroup "$g" "$bin" launch --manifest "$work/manifest.toml" --node "n$i" \
    --metrics "$work/pp4.jsonl" "$work/pp4.toml" > "$work/n$i.out" 2>&1 &
  pids+=($!)
done
fail=0
for i in $(seq 0 $((ranks - 1))); do wait "${pids[$i]}" || fail=1; done
echo "wall $(( $(date +%s) - start )) s"
for i in $(seq 0 $((ranks - 1))); do
  g=$cgroups/pipetrain-big-n$i
  line=$(grep -h "peak memory" "$work/n$i.out" | tail -1 || true)
  echo "rank $i: ${line:-no peak line} | cgroup peak $(( $(cat "$g/memory.max_usage_in_bytes") / 1000000 )) MB, OOM kills $(oom_kills "$g")"
done
if [ "$fail" -ne 0 ]; then
  for i in $(seq 0 $((ranks - 1))); do echo "--- rank $i"; tail -5 "$work/n$i.out"; done
  exit 1
fi
echo "losses: $(python3 -c "import json,sys; print([round(json.loads(l)['loss'], 5) for l in open(sys.argv[1]) if 'loss' in l])" "$work/pp4.jsonl")"

if [ "${REFERENCE:-1}" = 1 ]; then
  echo "== the reference: pp = 1 in one process without a cap (needs ~16 GB)"
  config 1 > "$work/ref.toml"
  /usr/bin/time -f "peak RSS %M KB, %e s" "$bin" train --metrics "$work/ref.jsonl" "$work/ref.toml" > "$work/ref.out" 2>&1 || { tail -5 "$work/ref.out"; exit 1; }
  tail -1 "$work/ref.out"
  echo "losses: $(python3 -c "import json,sys; print([round(json.loads(l)['loss'], 5) for l in open(sys.argv[1]) if 'loss' in l])" "$work/ref.jsonl")"
  python3 - "$work/pp4.jsonl" "$work/ref.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if "loss" in l] for p in sys.argv[1:])
print(f"the launched layout against pp = 1: max |loss difference| {max(abs(x - y) for x, y in zip(a, b)):.3g} over {len(a)} steps")
PY
fi
