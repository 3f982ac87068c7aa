#!/usr/bin/env bash
# runtime.flash_attention on the CPU, A/B: the built-in GPT-2 small (12 layers, d 768,
# 12 heads, vocabulary 50257) at batch B x SEQ tokens, SGD, float32, trained with
# fused attention keeping its probabilities (off) and keeping its rows' log-sum-exps (on),
# in alternating windows, each a fresh process: peak RSS (GNU time's maximum resident set)
# and the median step time (the metrics' `step_s`, first and last steps left out), and
# their ratios per round.
#
#   bash benches/flash_cpu.sh [rounds] [batch] [seq] [steps]   (default 2 1 1024 4)
#
# Scratch: a temporary folder (configs, metrics, logs). pipetrain: target/release/pipetrain
# (built with --features cli if missing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-2} batch=${2:-1} seq=${3:-1024} steps=${4:-4}
bin=$root/target/release/pipetrain
[ -x /usr/bin/time ] || { echo "flash_cpu.sh: needs GNU time at /usr/bin/time (apt-get install time)" >&2; exit 1; }
[ -x "$bin" ] || cargo build --release --features cli --manifest-path "$root/Cargo.toml" -q
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so* | head -1)}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
config() { # FLASH
  cat <<EOF
batch_size = $batch
num_train_steps = $steps
display_loss_steps = 1
[model]
kind = "gpt2"
layers = 12
d_model = 768
heads = 12
vocab = 50257
seq = $seq
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = { kind = "language", samples = $((batch * steps)), seq = $seq, vocab = 50257, seed = 7 }
layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 1e-4
[runtime]
flash_attention = $1
EOF
}
median_step() { # METRICS
  python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r["step_s"] for r in rows[1:-1] if r.get("step_s")]
print(statistics.median(steps) if steps else "nan")
EOF
}
echo "GPT-2 small, batch $batch x $seq, $steps steps a window, $(nproc) cores"
for r in $(seq 1 "$rounds"); do
  for flash in false true; do
    config $flash > "$scratch/cfg.toml"
    /usr/bin/time -f %M -o "$scratch/rss" "$bin" train "$scratch/cfg.toml" \
      --metrics "$scratch/m_$flash.jsonl" > "$scratch/log_$flash" 2>&1 \
      || { tail -5 "$scratch/log_$flash"; exit 1; }
    rss[$([ $flash = true ] && echo 1 || echo 0)]=$(cat "$scratch/rss")
    step[$([ $flash = true ] && echo 1 || echo 0)]=$(median_step "$scratch/m_$flash.jsonl")
    rm -f "$scratch/m_$flash.jsonl"
  done
  python3 -c "
r, s = [$((rss[0])), $((rss[1]))], [${step[0]}, ${step[1]}]
print(f'round $r: peak RSS off {r[0]/2**20:.2f} GiB, on {r[1]/2**20:.2f} GiB (on/off {r[1]/r[0]:.3f}); '
      f'median step off {s[0]:.2f} s, on {s[1]:.2f} s (on/off {s[1]/s[0]:.3f})')"
done
