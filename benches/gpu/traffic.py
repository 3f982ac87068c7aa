"""What a run's stages on the GPU copied between host and device in its last step, from
the `host traffic of the step` lines `pipetrain train` logs with
`RUST_LOG=pipetrain::device=debug` (one line a stage and replica each step): bytes to the
device and to the host, summed over the stages and replicas.

    python3 traffic.py LABEL RUN.log
"""
import re
import sys


def main():
    label, log = sys.argv[1], sys.argv[2]
    rows = []
    for line in open(log, errors="replace"):
        if "host traffic of the step" not in line:
            continue
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        got = {k: int(v) for k, v in re.findall(r"(step|to_device|to_host)=(\d+)", line)}
        if len(got) == 3:
            rows.append(got)
    if not rows:
        print(f"{label}: no host traffic lines (RUST_LOG=pipetrain::device=debug?)")
        return 1
    last = max(r["step"] for r in rows)
    at = [r for r in rows if r["step"] == last]
    down = sum(r["to_device"] for r in at) / 1e6
    up = sum(r["to_host"] for r in at) / 1e6
    print(f"{label}: step {last}, {len(at)} stage(s): {down:.3f} MB to the device, {up:.3f} MB to the host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
