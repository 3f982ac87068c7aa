"""A GPU-side profile from Nsight Compute: each kernel's time on the device
(`gpu__time_duration.sum`), grouped by kernel, with the matrix products and the rest
apart. ONNX Runtime's own profile times kernels on the host (their launches), which says
nothing of where the device spends a step; this does.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
        --print-units base --launch-skip S --launch-count N --log-file K.csv PROGRAM...
    python3 ncu_kernels.py K.csv [--top 25]
"""
import argparse
import collections
import csv
import re
import sys

PRODUCT = re.compile(r"gemm|gemv|xmma|cutlass|Kernel2|cublas|sm90_|sm80_|s1688|s16816", re.I)


def rows(path):
    text = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(text) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no CSV header from ncu (see the log for why)")
    reader = csv.DictReader(text[start:])
    for r in reader:
        value = r.get("gpu__time_duration.sum", "")
        try:
            ns = float(value.replace(",", ""))
        except ValueError:
            continue  # the units row
        yield r.get("Kernel Name", "?"), ns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    by = collections.defaultdict(lambda: [0, 0.0])
    total, count, products = 0.0, 0, 0.0
    for name, ns in rows(a.csv):
        short = re.sub(r"^void |[<(].*", "", name)[:70]
        by[short][0] += 1
        by[short][1] += ns
        total += ns
        count += 1
        if PRODUCT.search(name):
            products += ns
    if not count:
        sys.exit(f"{a.csv}: no kernel rows")
    print(f"{count} kernels, {total / 1e6:.1f} ms on the device; matrix products "
          f"{products / 1e6:.1f} ms ({100 * products / total:.0f}%), the rest {(total - products) / 1e6:.1f} ms")
    for short, (n, ns) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{ns / 1e6:8.2f} ms {100 * ns / total:5.1f}% {n:5d}x  {short}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
