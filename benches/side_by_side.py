"""Training steps/s of pipetrain against the peers (ONNX Runtime's training build,
PyTorch eager), measured fairly on a noisy machine: windows alternate between the
peers and pipetrain (ORT, pipetrain, torch, pipetrain, ...), and every ratio is taken
within one round, so drift between minutes does not land in it.

Each round, for a (model, optimizer):
  - one window of each peer: `bench.py --reps 1 --warmup 10 --window 50` in a fresh
    process (the peers' own harness: same model, weights, data, batch order, 2 threads);
  - a pipetrain window after each peer: `pipetrain train` (the whole engine: actors,
    data, optimizer, metrics) of 60 steps on the same data, steps/s over steps 11-60
    from its metrics file;
  - the GEMM rate of the machine (ONNX Runtime MatMul, 1024^3, 2 threads), so each
    round also says how close every engine comes to the step's matmul limit.

Reported per (model, optimizer): the median and range over rounds of pipetrain / best
peer, pipetrain / each peer, and each engine's share of the matmul limit; peak RSS of
each process (/usr/bin/time). Run by benches/side_by_side.sh, which prepares the peers.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "tools" / "peers"
PEERS_PY = Path(os.environ["PEERS_SCRATCH"]) / "venv" / "bin" / "python"
BIN = ROOT / "target" / "release" / "pipetrain"

# Forward matmul FLOPs of one training batch; a training step is forward + backward
# (input and weight gradients): 3x. mlp: 64 x (784x512 + 512x512 + 512x10) multiply-adds.
# tiny_gpt: 512 tokens x per layer (qkv 128x384, proj 128x128, fc 128x512, proj 512x128)
# + attention (8 x 4 heads x 64 x 64 x 32, twice) x 2 layers + head 128x512.
MLP_FWD = 2 * 64 * (784 * 512 + 512 * 512 + 512 * 10)
GPT_FWD = 2 * (2 * 512 * (128 * 384 + 128 * 128 + 128 * 512 + 512 * 128)
               + 2 * 2 * 8 * 4 * 64 * 64 * 32) + 2 * 512 * 128 * 512
FLOPS = {"mlp": 3 * MLP_FWD, "tiny_gpt": 3 * GPT_FWD}

CONFIG = {
    ("mlp", "sgd"): "mlp_sgd.toml",
    ("mlp", "adamw"): "mlp_adamw.toml",
    ("tiny_gpt", "sgd"): "tiny_gpt_sgd.toml",
    ("tiny_gpt", "adamw"): "tiny_gpt_adamw.toml",
}


def timed_rss(cmd, cwd=None, env=None):
    """Runs cmd under /usr/bin/time; (stdout, peak RSS in MiB)."""
    with tempfile.NamedTemporaryFile(suffix=".rss") as f:
        out = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", f.name, *cmd], cwd=cwd,
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{cmd}: {out.stderr[-2000:]}")
        return out.stdout, int(Path(f.name).read_text().split()[-1]) / 1024


def peer_window(peer, model, opt):
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    out, rss = timed_rss([str(PEERS_PY), "bench.py", "--peer", peer, "--model", model,
                          "--mode", "train", "--opt", opt, "--reps", "1", "--warmup", "10",
                          "--window", "50"], cwd=PEERS, env=env)
    return json.loads(out.strip().splitlines()[-1])["steps_per_s_median"], rss


def pipetrain_config(model, opt, scratch):
    """The example's configuration for 60 steps, data from the peers, no export."""
    text = (ROOT / "examples" / CONFIG[(model, opt)]).read_text()
    data = str(ROOT / "peers/data")
    text = text.replace("../peers/data", data)
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if key == "num_train_steps":
            line = "num_train_steps = 60"
        if key in ("output_path", "display_loss_steps"):
            continue
        lines.append(line)
    path = scratch / f"{model}_{opt}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def pipetrain_window(config, scratch):
    metrics = scratch / "metrics.jsonl"
    _, rss = timed_rss([str(BIN), "train", str(config), "--metrics", str(metrics)])
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    t = {r["step"]: r["elapsed_s"] for r in rows}
    return 50 / (t[60] - t[10]), rss


def gemm_rate():
    """GFLOP/s of ONNX Runtime's MatMul, 1024^3, 2 threads (best of 5)."""
    code = r"""
import time, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
n = 1024
g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
     helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
    [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
a = np.random.rand(n, n).astype(np.float32); b = np.random.rand(n, n).astype(np.float32)
s.run(None, {"a": a, "b": b})
best = 0
for _ in range(5):
    t = time.perf_counter(); [s.run(None, {"a": a, "b": b}) for _ in range(5)]
    best = max(best, 5 * 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
print(best)
"""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def summary(values):
    return statistics.median(values), min(values), max(values)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cases", default="mlp:sgd,mlp:adamw,tiny_gpt:sgd,tiny_gpt:adamw")
    ap.add_argument("--json", type=Path, help="also write every window here")
    a = ap.parse_args()
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="side_by_side_"))
    windows = []
    for model, opt in cases:
        config = pipetrain_config(model, opt, scratch)
        for r in range(a.rounds):
            rate = gemm_rate()
            row = dict(model=model, opt=opt, round=r, gemm_gflops=rate)
            for peer in ("ort", "torch"):
                row[peer], row[f"{peer}_rss"] = peer_window(peer, model, opt)
                row[f"pipetrain_after_{peer}"], row["pipetrain_rss"] = pipetrain_window(config, scratch)
            windows.append(row)
            print(f"{model} {opt} round {r}: ort {row['ort']:.1f}, torch {row['torch']:.1f}, "
                  f"pipetrain {row['pipetrain_after_ort']:.1f} / {row['pipetrain_after_torch']:.1f} steps/s, "
                  f"GEMM {rate:.0f} GFLOP/s", file=sys.stderr, flush=True)
    if a.json:
        a.json.write_text(json.dumps(windows, indent=1))
    print(f"\n## pipetrain train vs the peers, {a.rounds} alternating rounds per row "
          f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; median [min-max] of per-round ratios)\n")
    print("| model | opt | pipetrain / best peer | / ORT | / PyTorch | pipetrain steps/s | "
          "share of matmul limit: pipetrain / ORT / PyTorch | peak RSS MiB: pipetrain / ORT / PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    for model, opt in cases:
        rows = [w for w in windows if (w["model"], w["opt"]) == (model, opt)]
        best, vs_ort, vs_torch, ours, share = [], [], [], [], {"p": [], "o": [], "t": []}
        for w in rows:
            p_ort, p_torch = w["pipetrain_after_ort"], w["pipetrain_after_torch"]
            vs_ort.append(p_ort / w["ort"])
            vs_torch.append(p_torch / w["torch"])
            best.append(min(p_ort / w["ort"], p_torch / w["torch"]) if w["ort"] > 0 else 0)
            ours += [p_ort, p_torch]
            limit = w["gemm_gflops"] * 1e9 / FLOPS[model]
            share["p"].append((p_ort + p_torch) / 2 / limit)
            share["o"].append(w["ort"] / limit)
            share["t"].append(w["torch"] / limit)
        fmt = lambda v: "{:.2f}x [{:.2f}-{:.2f}]".format(*summary(v))
        pct = lambda v: "{:.0f}%".format(100 * statistics.median(v))
        rss = lambda k: "{:.0f}".format(max(w[k] for w in rows))
        print(f"| {model} | {opt} | {fmt(best)} | {fmt(vs_ort)} | {fmt(vs_torch)} | "
              f"{statistics.median(ours):.1f} | {pct(share['p'])} / {pct(share['o'])} / {pct(share['t'])} | "
              f"{rss('pipetrain_rss')} / {rss('ort_rss')} / {rss('torch_rss')} |")
    print(f"\nMatmul limit: the step's matmul FLOPs (mlp {FLOPS['mlp'] / 1e9:.3f} GFLOP, tiny_gpt "
          f"{FLOPS['tiny_gpt'] / 1e9:.3f} GFLOP) at the measured GEMM rate "
          f"(median {statistics.median(w['gemm_gflops'] for w in windows):.0f} GFLOP/s).")


if __name__ == "__main__":
    main()
