"""Tokens/s of a `pipetrain train --metrics` run, over the steps after the first `skip`
(warm-up), from the metrics' `elapsed_s`; and the model FLOPs it implies.

    python3 gpt2_speed.py METRICS.jsonl TOKENS_PER_STEP PARAMS [--skip 3]
"""
import json
import sys


def main():
    path, tokens, params = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    skip = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    rows = [json.loads(line) for line in open(path) if line.strip()]
    key = "elapsed_s" if "elapsed_s" in rows[0] else next(k for k in rows[0] if "elapsed" in k)
    a, b = rows[skip - 1], rows[-1]
    dt = b[key] - a[key]
    n = len(rows) - skip
    tps = n * tokens / dt
    print(f"pipetrain: {n} steps in {dt:.2f} s: {tps:.0f} tokens/s "
          f"(~{6 * params * tps / 1e12:.1f} TFLOP/s at 6 x params per token), "
          f"last loss {b['loss']:.4f}")


if __name__ == "__main__":
    main()
