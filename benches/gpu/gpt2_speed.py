"""Tokens/s of a `pipetrain train --metrics` run: the median of the steps' `step_s`,
leaving out the first (warm-up) and the last (its record is written right after the one
before it, so its `step_s` is near zero), and the model FLOPs utilization it implies
(peak.py: PaLM's count; with the model's shape, layers, d and sequence, and the
precision of its products).

    python3 gpt2_speed.py METRICS.jsonl TOKENS_PER_STEP PARAMS [LAYERS D SEQ [PRECISION]]
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak import mfu_text  # noqa: E402


def main():
    path, tokens, params = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    shape = [int(v) for v in sys.argv[4:7]] if len(sys.argv) >= 7 else None
    precision = sys.argv[7] if len(sys.argv) >= 8 else "f32"
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r["step_s"] for r in rows[1:-1] if r.get("step_s")]
    if not steps:
        print(f"pipetrain: too few steps in {path} to time")
        return 1
    step = statistics.median(steps)
    tps = tokens / step
    flops = (mfu_text(tps, params, *shape, precision) if shape
             else f"~{6 * params * tps / 1e12:.1f} TFLOP/s at 6 x params per token")
    print(f"pipetrain: median step {step * 1e3:.0f} ms over {len(steps)} steps: {tps:.0f} tokens/s "
          f"({flops}), last loss {rows[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
