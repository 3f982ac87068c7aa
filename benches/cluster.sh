#!/usr/bin/env bash
# Training steps/s of one job at (dp, pp) = (2, 2): four `pipetrain launch` processes on
# loopback (127.0.0.1-4, authenticated TCP between them) against one `pipetrain train`
# process holding the same four stage actors, alternating windows (one process, four
# processes, ...) so drift between minutes lands in both. Prints each round's steps/s
# (as each run's own summary reports it: training only, set-up excluded) and the median
# of the per-round ratios with its range.
#
#   bash benches/cluster.sh [rounds] [config]   (default 5 rounds of the peers' tiny GPT,
#        dp 2 x pp 2, 1F1B, AdamW, 40 steps; a config must set dp = 2, pp = 2)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
cargo build --release --features cli -q
bin=$root/target/release/pipetrain
peers=$root/peers/data
if [ -n "${2:-}" ]; then
  cfg=$(realpath "$2")
else
  cfg=$work/tiny_gpt.toml
  cat > "$cfg" <<EOF
model_path = "$peers/tiny_gpt.onnx"
init_path = "$peers/tiny_gpt_init.safetensors"
output_path = "$work/out/model.onnx"
batch_size = 8
gradient_accumulation_steps = 2
num_train_steps = 80
data_parallel_size = 2
pipeline_parallel_size = 2
display_loss_steps = 1000
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
schedule = "1f1b"
EOF
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/cluster.secret")
manifest=$work/cluster.toml
{
  printf '[job]\nname = "bench"\nrendezvous = "127.0.0.1:%s"\nsecret_file = "cluster.secret"\n' "$(free_port)"
  printf '[layout]\ndata_parallel = 2\npipeline_parallel = 2\n'
  port=$(free_port)
  for i in 1 2 3 4; do
    printf '[[nodes]]\nname = "n%s"\naddress = "127.0.0.%s"\nport = %s\ncpu_slots = 1\n' "$i" "$i" "$port"
  done
} > "$manifest"
rate() { grep -o '[0-9.]* steps/s' | head -1 | cut -d' ' -f1; }
one=() four=()
for r in $(seq "$rounds"); do
  a=$("$bin" train "$cfg" 2>&1 | rate)
  b=$(for i in 1 2 3 4; do "$bin" launch --manifest "$manifest" --node "n$i" "$cfg" 2>"$work/n$i.log" >/dev/null & done; wait; rate < "$work/n1.log")
  one+=("$a"); four+=("$b")
  echo "round $r: one process $a steps/s, four processes $b steps/s"
done
python3 - "${one[*]}" "${four[*]}" <<'EOF'
import statistics, sys
one = [float(x) for x in sys.argv[1].split()]
four = [float(x) for x in sys.argv[2].split()]
r = sorted(f / o for f, o in zip(four, one))
print(f"four processes / one process: median {statistics.median(r):.2f}x (range {r[0]:.2f}-{r[-1]:.2f}) over {len(r)} rounds")
EOF
