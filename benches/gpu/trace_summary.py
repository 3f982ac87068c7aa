"""Where a run's time goes, from a Chrome trace written by `pipetrain train
--chrome-trace`: each kind of action (F = forward, B = backward, SEND_/RECV_ transfers,
the optimizer step, ...; digits, the micro-batch and stage numbers, left out) with its
count, total and mean duration.

    python3 trace_summary.py TRACE.json
"""
import collections
import json
import re
import sys


def main():
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    count, total = collections.Counter(), collections.Counter()
    for ev in events:
        if ev.get("ph") == "X":
            kind = re.sub(r"\d+", "", ev.get("name", "?")) or "?"
            count[kind] += 1
            total[kind] += ev.get("dur", 0)
    for kind, us in total.most_common():
        print(f"{kind:>12}: {count[kind]:6d} x {us / count[kind] / 1e3:9.2f} ms = {us / 1e3:10.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
