#!/usr/bin/env bash
# pipetrain with its fused kernels against pipetrain without them (`runtime.fused_kernels
# = false`, the same graphs in standard ops), alternating runs so the ratios mean
# something on a noisy VM: per round, one run of each, in alternating order; steps/s from
# the run's own summary (graph building and sessions excluded). Prints the median and
# range of the per-round ratios (fused / unfused).
#
#   bash benches/fused_ab.sh [rounds] [configs...]   (default 7 rounds of
#        examples/tiny_gpt_sgd.toml and examples/tiny_gpt_adamw.toml, 200 steps each; the
#        peers' tiny GPT peers/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-7}
shift || true
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=("$root/examples/tiny_gpt_sgd.toml" "$root/examples/tiny_gpt_adamw.toml")
cargo build --release --features cli --manifest-path "$root/Cargo.toml" -q
bin=$root/target/release/pipetrain
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rate() { # config -> steps/s
  "$bin" train "$1" 2>&1 | sed -n 's/^done: .* \([0-9.]*\) steps\/s.*/\1/p' | tail -1
}
for cfg in "${configs[@]}"; do
  name=$(basename "$cfg" .toml)
  dir=$(cd "$(dirname "$cfg")" && pwd)
  for f in true false; do
    # Same folder as the original, so its relative paths hold; no outputs written.
    grep -v '^output_path' "$cfg" | grep -v '^\[runtime\]' > "$dir/.fused_ab_$f.toml"
    printf '\n[runtime]\nfused_kernels = %s\n' "$f" >> "$dir/.fused_ab_$f.toml"
  done
  ratios=()
  for r in $(seq "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then
      on=$(rate "$dir/.fused_ab_true.toml"); off=$(rate "$dir/.fused_ab_false.toml")
    else
      off=$(rate "$dir/.fused_ab_false.toml"); on=$(rate "$dir/.fused_ab_true.toml")
    fi
    ratios+=("$(python3 -c "print($on / $off)")")
    echo "  $name round $r: fused $on, unfused $off steps/s"
  done
  rm -f "$dir/.fused_ab_true.toml" "$dir/.fused_ab_false.toml"
  python3 - "$name" "${ratios[@]}" <<'PY'
import statistics, sys
name, xs = sys.argv[1], sorted(float(x) for x in sys.argv[2:])
print(f"{name}: fused / unfused steps/s, median {statistics.median(xs):.3f} [{xs[0]:.3f}-{xs[-1]:.3f}] over {len(xs)} rounds")
PY
done
