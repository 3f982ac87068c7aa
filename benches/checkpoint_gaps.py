"""Where a checkpoint's cost lands in a run, from `pipetrain train CONFIG --trace FILE`.

Reads the traces of a run without checkpoints and one with `checkpoint_period = P`
(replica 0, rank 0) and prints, per run: the median step, the median gap between steps
(the checkpoint's snapshot round shows as a longer gap every P steps), and the median
length of the k-th step after a checkpoint (the background write slows the steps it
overlaps), with the extra milliseconds each costs against the run without.

    python3 benches/checkpoint_gaps.py PLAIN_TRACE SAVING_TRACE [PERIOD]   (default 10)
"""
import json
import statistics
import sys


def spans(path):
    steps = json.load(open(path))["steps"]
    out = []
    for replicas in steps:
        events = replicas[0]["ranks"][0]
        out.append((min(e["start_ns"] for e in events), max(e["end_ns"] for e in events)))
    return out


def profile(path, period):
    s = spans(path)
    durs = [(e - b) / 1e6 for b, e in s]
    gaps = [(s[i + 1][0] - s[i][1]) / 1e6 for i in range(len(s) - 1)]
    at_ck = [gaps[i] for i in range(period - 1, len(gaps), period)]
    after = [
        statistics.median(durs[i] for i in range(period + k, len(durs), period))
        for k in range(period)
    ]
    return statistics.median(durs), statistics.median(gaps), statistics.median(at_ck), after


def main():
    plain, saving = sys.argv[1], sys.argv[2]
    period = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    p_step, p_gap, _, _ = profile(plain, period)
    s_step, s_gap, s_ck, after = profile(saving, period)
    print(f"without: step {p_step:.3f} ms, gap {p_gap:.3f} ms")
    print(f"with:    step {s_step:.3f} ms, gap {s_gap:.3f} ms, gap at a checkpoint {s_ck:.3f} ms")
    extra = [a - p_step for a in after]
    for k, (a, x) in enumerate(zip(after, extra)):
        print(f"  step {k} after a checkpoint: {a:.3f} ms ({x:+.3f})")
    per = s_ck - p_gap + sum(x for x in extra if x > 0)
    window = period * (p_step + p_gap)
    print(f"per checkpoint: snapshot round {s_ck - p_gap:.3f} ms + slower steps "
          f"{sum(x for x in extra if x > 0):.3f} ms = {per:.3f} ms of {window:.3f} ms "
          f"({100 * per / window:.1f}%)")


main()
