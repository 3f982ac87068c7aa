"""How much of a pipeline's compute overlaps across stages in a Chrome trace written by
`pipetrain train --chrome-trace` (complete events, one track per pipeline rank).

    python3 overlap.py TRACE.json

Prints each rank's busy time and the time during which two ranks (and, with more
tracks, three, four, ...) were busy at once.
"""
import json
import sys


def merged(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def main():
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    tracks = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("dur", 0) > 0:
            tracks.setdefault((ev.get("pid"), ev.get("tid")), []).append(
                (ev["ts"], ev["ts"] + ev["dur"]))
    busy = {k: merged(v) for k, v in tracks.items()}
    for k, v in sorted(busy.items(), key=lambda kv: str(kv[0])):
        print(f"track {k}: {len(tracks[k])} events, busy {sum(e - s for s, e in v) / 1e3:.1f} ms")
    keys = sorted(busy, key=str)
    if len(keys) < 2:
        print("fewer than two tracks: no overlap to measure")
        return 0
    # Time covered by at least n tracks at once, n = 2.. tracks: sweep over all edges.
    edges = sorted([(s, 1) for k in keys for s, _ in busy[k]] +
                   [(e, -1) for k in keys for _, e in busy[k]], key=lambda x: (x[0], x[1]))
    at_least = [0.0] * (len(keys) + 1)
    depth, last = 0, None
    for t, d in edges:
        if last is not None:
            for n in range(2, depth + 1):
                at_least[n] += t - last
        depth += d
        last = t
    print(f"two or more tracks busy at once: {at_least[2] / 1e3:.1f} ms")
    for n in range(3, len(keys) + 1):
        print(f"{n} or more tracks busy at once: {at_least[n] / 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
