#!/usr/bin/env bash
# Activation recompute on the peers' tiny GPT at pp = 2 with 8 micro-batches of 8 (AdamW,
# 20 optimizer steps), under 1F1B, ZB-H1 and ZB-V: each stage's peak stash (measured by the
# stage, and predicted from the stage graphs' value sizes along the schedule), the
# process's peak RSS, and steps/s, with recompute = "none" and "stage" in alternating
# windows (none, stage, none, ...) so drift lands in both; the step-time cost is the
# median of per-round ratios.
#
#   bash benches/recompute.sh [rounds]   (default 5)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-5}
peers=$root/peers/data
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
cargo build --release --features cli -q
bin=$root/target/release/pipetrain
config() {
  cat <<EOF
model_path = "$peers/tiny_gpt.onnx"
init_path = "$peers/tiny_gpt_init.safetensors"
batch_size = 8
gradient_accumulation_steps = 8
num_train_steps = 160
pipeline_parallel_size = 2
display_loss_steps = 1000
recompute = "$2"
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
path = "$peers/tiny_gpt_data.npz"
layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "constant"
lr = 1e-3
[pipeline]
schedule = "$1"
EOF
}
for schedule in 1f1b zb_h1 zb_v; do
  for r in none stage; do config "$schedule" "$r" > "$work/$schedule-$r.toml"; done
  for round in $(seq "$rounds"); do
    for r in none stage; do
      /usr/bin/time -f "rss %M" "$bin" train "$work/$schedule-$r.toml" > /dev/null 2> "$work/out"
      rate=$(grep -o 'done: .*' "$work/out" | grep -o '[0-9.]* steps/s' | cut -d' ' -f1)
      rss=$(awk '/^rss/ {print $2}' "$work/out")
      stash=$(grep -o 'peak stash MiB.*' "$work/out" | sed 's/peak stash MiB (measured\/predicted): //')
      echo "$schedule $r $round $rate $rss $stash" | tee -a "$work/rows"
    done
  done
done
python3 - "$work/rows" <<'EOF'
import statistics, sys
rows = [l.split(maxsplit=5) for l in open(sys.argv[1])]
print("\n| schedule | recompute | steps/s (median) | peak RSS MiB (median) | peak stash MiB per stage (measured/predicted) | step time vs none |")
print("|---|---|---|---|---|---|")
for sched in ["1f1b", "zb_h1", "zb_v"]:
    by = {r: [x for x in rows if x[0] == sched and x[1] == r] for r in ["none", "stage"]}
    ratios = sorted(float(n[3]) / float(s[3]) for n, s in zip(by["none"], by["stage"]))
    for r in ["none", "stage"]:
        xs = by[r]
        rate = statistics.median(float(x[3]) for x in xs)
        rss = statistics.median(int(x[4]) for x in xs) / 1024
        cost = "-" if r == "none" else f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
        print(f"| {sched} | {r} | {rate:.1f} | {rss:.0f} | {xs[0][5].strip()} | {cost} |")
EOF
