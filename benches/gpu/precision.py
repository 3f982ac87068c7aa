"""Mixed precision against float32: the loss curves of `pipetrain train --metrics` runs
(JSON Lines) of one configuration in float32, float16 and bfloat16, and a float16 run
with an overflow injected at one step.

    python3 precision.py F32.jsonl F16.jsonl BF16.jsonl OVERFLOW.jsonl STEP --tol T

Prints one line per check; exits 1 when a half-precision curve is further than T from
float32 at some step, or bitwise equal to it (then the casts did nothing), or the
injected step was not skipped with the loss scale halved after it.
"""
import argparse
import json
import sys


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("f32")
    ap.add_argument("f16")
    ap.add_argument("bf16")
    ap.add_argument("overflow")
    ap.add_argument("step", type=int)
    ap.add_argument("--tol", type=float, required=True)
    a = ap.parse_args()
    base = [r["loss"] for r in records(a.f32)]
    ok = True
    for name, path in (("float16", a.f16), ("bfloat16", a.bf16)):
        half = [r["loss"] for r in records(path)]
        if len(half) != len(base):
            print(f"precision {name}: {len(half)} steps against {len(base)}: FAIL")
            ok = False
            continue
        diffs = [abs(x - y) for x, y in zip(half, base)]
        worst = max(diffs)
        at = diffs.index(worst) + 1
        same = worst == 0.0
        good = worst <= a.tol and not same
        ok &= good
        note = " (bitwise float32: the casts did nothing)" if same else ""
        print(f"precision {name}: {len(half)} steps, max |loss - float32| = {worst:.2e} at step {at}, "
              f"last {half[-1]:.6f} against {base[-1]:.6f}; tolerance {a.tol:g}: {'ok' if good else 'FAIL'}{note}")
    runs = records(a.overflow)
    by_step = {r["step"]: r for r in runs}
    hit = by_step.get(a.step, {})
    before = by_step.get(a.step - 1, {}).get("loss_scale")
    after = by_step.get(a.step + 1, {}).get("loss_scale")
    skipped = [r["step"] for r in runs if r.get("skipped")]
    halved = before is not None and after is not None and after == before / 2
    good = skipped == [a.step] and halved
    ok &= good
    print(f"overflow injected at step {a.step} (float16, dynamic loss scale): skipped steps {skipped}, "
          f"scale {before} before, {after} after: {'ok' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
