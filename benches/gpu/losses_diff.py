"""Two `pipetrain train --metrics` runs' losses side by side: bitwise equal, or the largest
difference, step by step.

    python3 losses_diff.py LABEL A.jsonl B.jsonl
"""
import json
import sys


def main():
    label, a, b = sys.argv[1], *([json.loads(l)["loss"] for l in open(p) if l.strip()] for p in sys.argv[2:4])
    n = min(len(a), len(b))
    if a == b:
        print(f"{label}: losses bitwise equal over {n} steps")
    else:
        d = max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))
        print(f"{label}: losses differ by at most {d:.3g} over {n} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
