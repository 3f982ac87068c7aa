"""Compares loss curves of `pipetrain train --metrics` runs (JSON Lines, one object per
optimizer step): a GPU run against the CPU run of the same configuration and, where
given, the peers' PyTorch float64 curve (`loss_<run>.csv`, column torch_f64).

    python3 curves.py NAME GPU.jsonl CPU.jsonl [REFERENCE.csv] --tol T

Prints one line; exits 1 when the GPU curve is further than T at any step from the
float64 reference (from the CPU run where there is none), or the runs differ in length.
(The reference, not the CPU run, is the judge: a CPU run is float32 noise too, and on a
16-core machine the MLP under AdamW drifts 1.4e-2 from float64; see RESULTS.md.)
"""
import argparse
import csv
import json
import sys


def losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("gpu")
    ap.add_argument("cpu")
    ap.add_argument("reference", nargs="?")
    ap.add_argument("--tol", type=float, required=True)
    a = ap.parse_args()
    gpu, cpu = losses(a.gpu), losses(a.cpu)
    if len(gpu) != len(cpu) or not gpu:
        print(f"{a.name}: FAIL: {len(gpu)} GPU steps, {len(cpu)} CPU steps")
        return 1
    diff = [abs(g - c) for g, c in zip(gpu, cpu)]
    worst = max(range(len(diff)), key=diff.__getitem__)
    line = (f"{a.name}: {len(gpu)} steps, max |gpu - cpu| = {diff[worst]:.2e} at step "
            f"{worst + 1} (first loss {gpu[0]:.6f}, last {gpu[-1]:.6f})")
    judged = diff[worst]
    if a.reference:
        with open(a.reference) as f:
            ref = [float(r["torch_f64"]) for r in csv.DictReader(f)][: len(gpu)]
        judged = max(abs(g - r) for g, r in zip(gpu, ref))
        line += f", max |gpu - torch_f64| = {judged:.2e}"
    ok = judged <= a.tol
    print(f"{line}; tolerance {a.tol:.0e}: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
