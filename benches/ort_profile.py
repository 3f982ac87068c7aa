"""Where a session's time goes, from an ONNX Runtime profile (`[runtime] profile = true`
writes one `pipetrain_<session>_<time>.json` per session into the working folder).

    python3 benches/ort_profile.py PROFILE.json [--top 15] [--skip 10]

Prints, per run of the session (the first `--skip` runs, warm-up, left out): the
kernels' time by operator type, the matmuls' share, ONNX Runtime's own time around the
kernels, and the slowest nodes. Standard library only.
"""
import argparse
import collections
import json

MATMULS = ("Gemm", "FusedMatMul", "MatMul")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--skip", type=int, default=10)
    a = ap.parse_args()
    events = json.load(open(a.profile))
    runs = sorted(e["ts"] for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    if len(runs) <= a.skip:
        raise SystemExit(f"{a.profile}: {len(runs)} runs, none left after skipping {a.skip}")
    start = runs[a.skip]
    n = len(runs) - a.skip
    by_op = collections.defaultdict(float)
    by_node = collections.defaultdict(float)
    op_of = {}
    run_us = 0.0
    for e in events:
        if e.get("ts", 0) < start:
            continue
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            run_us += e["dur"]
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            op = e["args"].get("op_name", "?")
            by_op[op] += e["dur"]
            by_node[node] += e["dur"]
            op_of[node] = op
    kernels = sum(by_op.values())
    matmul = sum(v for k, v in by_op.items() if k in MATMULS)
    print(f"{a.profile}: {n} runs after {a.skip} skipped; {len(by_node)} kernels a run\n")
    print("| part | us/run | share of the run |\n|---|---|---|")
    print(f"| run (ONNX Runtime) | {run_us / n:.0f} | 100% |")
    print(f"| kernels | {kernels / n:.0f} | {100 * kernels / run_us:.1f}% |")
    print(f"| of which matmuls ({', '.join(MATMULS)}) | {matmul / n:.0f} | {100 * matmul / run_us:.1f}% |")
    print(f"| ONNX Runtime around the kernels | {(run_us - kernels) / n:.0f} | "
          f"{100 * (run_us - kernels) / run_us:.1f}% |")
    print("\n| operator | us/run | share of kernels |\n|---|---|---|")
    for op, us in sorted(by_op.items(), key=lambda x: -x[1])[: a.top]:
        print(f"| {op} | {us / n:.0f} | {100 * us / kernels:.1f}% |")
    print("\n| node | operator | us/run |\n|---|---|---|")
    for node, us in sorted(by_node.items(), key=lambda x: -x[1])[: a.top]:
        print(f"| {node} | {op_of[node]} | {us / n:.0f} |")


if __name__ == "__main__":
    main()
