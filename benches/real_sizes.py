"""pipetrain against PyTorch eager at real sizes, on the CPU: GPT-2 small (124M), a
BERT-base sequence classifier (110M) and ViT-B/16 (86M), in windows that alternate
(PyTorch, pipetrain, PyTorch, pipetrain, ...), each ratio taken within one round so that
drift between minutes does not land in it.

The models, random-initialized (torch.manual_seed(0)), every dropout probability 0,
float32:
  gpt2  transformers.GPT2LMHeadModel(GPT2Config()), batch 4 x 128 tokens, next-token
        labels [4, 128] (rows of 129 random tokens: tokens[:, :128], tokens[:, 1:]);
  bert  transformers.BertForSequenceClassification(BertConfig(num_labels=2)), batch
        8 x 128 random tokens, labels [8] in {0, 1};
  vit   torchvision.models.vit_b_16(num_classes=1000), batch 8 x 3 x 224 x 224 N(0, 1)
        pixels, labels [8] in [0, 1000).
Loss: mean softmax cross entropy over the last axis; SGD (lr 1e-3, no momentum) in both
engines.

Each model is exported once into the scratch folder (--scratch, default $PIPETRAIN_SCRATCH
or ~/.cache/pipetrain-real-sizes; reused while its recipe is unchanged) with the README's
TorchScript call (dynamo=False, opset 17, training=TRAINING, do_constant_folding=False,
dynamic batch (and sequence) axes); the transformers are exported with eager attention
(the path pipetrain's tests cover; the weights are the same). Beside it: the initial
weights as a torch state dict (init.pt), the data (data.npz, 20 batches, cycled) and a
pipetrain config (model.toml).

Each round, for each model, two fresh processes, each under /usr/bin/time -v (peak RSS:
"Maximum resident set size"; psutil polling of the process tree where /usr/bin/time is
missing):
  - PyTorch: this file with --torch-window: imports torch, builds the model from its
    config (transformers' default attention, sdpa for both; --torch-attn eager for the
    exported one), loads init.pt, reads data.npz, then N steps of torch.optim.SGD on
    `--threads` threads (torch.set_num_threads, OMP/MKL_NUM_THREADS);
  - pipetrain: `pipetrain train model.toml --metrics FILE`, N steps; pipetrain chooses its
    own threads.
N: 20 steps for gpt2 and bert, 12 for vit (--steps to change). Both write one JSON line per
step, flushed, and the driver polls that file (every 5 ms):
  - time to first step: from just before the process is started to the moment the
    metrics file's first line appears (process start, imports, model build or graph
    building, weights, data, first step; the same clock and poll for both engines);
  - steps/s: (N - 2) / (end of step N - end of step 2), each process's own clock
    (pipetrain's `elapsed_s`, PyTorch's perf_counter): steps 3..N, after a 2-step warm-up.
Both start from the same weights and take the same batches, so their losses should agree
step by step to float32 rounding (about 1e-6 at these sizes): each round prints every
step's loss in both and their difference (Δloss), and the largest |difference| over a
window's steps, as a check that the two train the same model.

Each engine's share of the matrix-product limit (real_sizes_products.py): the step's
product FLOPs, counted by PyTorch's FlopCounterMode over one more forward and backward at
the end of the PyTorch window, at the GEMM rate a process of its own measures once per run
for each model (torch.matmul at its layer shapes, PyTorch's threads), over the step time.

Prints a Markdown table per round and a summary of median [min-max] of the per-round
ratios pipetrain / PyTorch; writes everything to SCRATCH/results-<time>.json.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

T_START = time.perf_counter()  # the PyTorch window's phases count from here

import numpy as np  # noqa: E402

import real_sizes_products as products  # noqa: E402
from real_sizes_models import (  # noqa: E402  (after T_START, as numpy)
    MODELS,
    ROOT,
    build,
    export,
    make_data,
    pipetrain_config,
    rows_of,
)

WARMUP = 2

# ----------------------------------------------------------------------------- windows


def torch_window(a) -> None:
    """One PyTorch window (this process): metrics lines to a.metrics, a summary line on
    stdout."""
    phases = {"python_start_to_main_s": time.perf_counter() - T_START}
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    phases["import_torch_s"] = time.perf_counter() - T_START
    folder = Path(a.folder)
    model, inputs = build(a.torch_window, attn=None if a.torch_attn == "default" else
                          a.torch_attn)
    phases["build_s"] = time.perf_counter() - T_START
    model.load_state_dict(torch.load(folder / "init.pt", weights_only=True))
    phases["load_weights_s"] = time.perf_counter() - T_START
    with np.load(folder / "data.npz") as z:
        data = {k: z[k] for k in z.files}
    phases["data_s"] = time.perf_counter() - T_START
    batch = MODELS[a.torch_window]["batch"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    marks, losses = [], []
    start = time.perf_counter()
    with open(a.metrics, "w") as out:
        for step in range(a.steps):
            b = rows_of(data, step, batch)
            logits = model(*(torch.from_numpy(b[k]) for k in inputs))
            logits = logits if isinstance(logits, torch.Tensor) else logits[0]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   torch.from_numpy(b["labels"]).reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            marks.append(time.perf_counter())
            losses.append(loss.item())
            out.write(json.dumps(dict(step=step + 1, loss=losses[-1],
                                      elapsed_s=marks[-1] - start)) + "\n")
            out.flush()
            if step == 0:
                phases["first_step_s"] = marks[0] - T_START

    def one_step():  # after the timed steps: its products counted, nothing applied
        b = rows_of(data, 0, batch)
        logits = model(*(torch.from_numpy(b[k]) for k in inputs))
        logits = logits if isinstance(logits, torch.Tensor) else logits[0]
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                        torch.from_numpy(b["labels"]).reshape(-1)).backward()

    flops = products.count_flops(one_step)
    print(json.dumps(dict(phases=phases, attn=getattr(getattr(model, "config", None),
                                                      "_attn_implementation", None),
                          threads=torch.get_num_threads(), product_flops=flops)), flush=True)


def parse_time_v(path: Path) -> dict:
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key == "Maximum resident set size (kbytes)":
            out["peak_rss_bytes"] = int(value) * 1024
        elif key == "Elapsed (wall clock) time (h:mm:ss or m:ss)":
            parts = [float(p) for p in value.split(":")]
            out["time_wall_s"] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return out


def run_window(cmd: list[str], metrics: Path, work: Path, env: dict, timeout: float,
               cwd: Path) -> dict:
    """Runs `cmd` in a fresh process, polling `metrics` for its first line; peak RSS by
    /usr/bin/time -v (else psutil polling of the process tree)."""
    metrics.unlink(missing_ok=True)
    time_v = work / "time-v.txt"
    time_v.unlink(missing_ok=True)
    timed = Path("/usr/bin/time").exists()
    full = ["/usr/bin/time", "-v", "-o", str(time_v), *cmd] if timed else cmd
    stdout, stderr = open(work / "stdout.txt", "w"), open(work / "stderr.txt", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
    first = None
    peak = 0
    ps = None
    if not timed:
        import psutil

        ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        now = time.perf_counter()
        if first is None:
            try:
                if b"\n" in metrics.read_bytes():
                    first = now - t0
            except FileNotFoundError:
                pass
        if ps is not None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [ps, *ps.children(True)]))
            except Exception:  # noqa: BLE001 - a child that just ended
                pass
        if now - t0 > timeout:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.005 if first is None else 0.05)
    total = time.perf_counter() - t0
    stdout.close()
    stderr.close()
    rec = dict(rc=proc.returncode, wall_s=total, time_to_first_step_s=first)
    if timed and time_v.exists():
        rec.update(parse_time_v(time_v))
    elif ps is not None:
        rec["peak_rss_bytes"] = peak
        rec["peak_rss_by"] = "psutil polling"
    rec.setdefault("peak_rss_by", "/usr/bin/time -v")
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    rows = [json.loads(x) for x in lines if x.strip()]
    rec["steps_done"] = len(rows)
    if rows:
        rec["losses"] = [r["loss"] for r in rows]
        rec["elapsed_s"] = [r["elapsed_s"] for r in rows]
        rec["loss_first"] = rows[0]["loss"]
        rec["loss_last"] = rows[-1]["loss"]
        rec["first_step_training_clock_s"] = rows[0]["elapsed_s"]
        t = {r["step"]: r["elapsed_s"] for r in rows}
        n = max(t)
        if n > WARMUP:
            rec["steps_per_s"] = (n - WARMUP) / (t[n] - t[WARMUP])
            rec["timed_steps"] = f"{WARMUP + 1}..{n}"
    if proc.returncode != 0:
        err = (work / "stderr.txt").read_text(errors="replace").strip().splitlines()
        rec["error"] = "\n".join(err[-15:]) or f"exit status {proc.returncode}"
    rec["stdout_tail"] = (work / "stdout.txt").read_text(errors="replace")[-2000:]
    rec["stderr_tail"] = (work / "stderr.txt").read_text(errors="replace")[-3000:]
    return rec


# ----------------------------------------------------------------------------- report


def gib(b) -> str:
    return f"{b / 2**30:.2f}" if b else "-"


def num(x, fmt) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def ratios(rec_p: dict, rec_t: dict) -> dict:
    out = {}
    for key in ("steps_per_s", "peak_rss_bytes", "time_to_first_step_s"):
        p, t = rec_p.get(key), rec_t.get(key)
        if p and t and rec_p.get("rc") == 0 and rec_t.get("rc") == 0:
            out[key] = p / t
    pairs = list(zip(rec_p.get("losses", []), rec_t.get("losses", [])))
    if pairs:
        out["max_abs_loss_diff"] = max(abs(p - t) for p, t in pairs)
    return out


def print_losses(round_rec: dict) -> None:
    """Each model's losses step by step in both engines, and their difference
    (pipetrain - PyTorch): the two train the same weights on the same batches."""
    for m, x in round_rec.items():
        lt, lp = x["torch"].get("losses", []), x["pipetrain"].get("losses", [])
        if not (lt or lp):
            continue
        print(f"{m}: losses by step\n")
        print("| step | PyTorch | pipetrain | Δloss (pipetrain - PyTorch) |")
        print("|---|---|---|---|")
        for i in range(max(len(lt), len(lp))):
            t = lt[i] if i < len(lt) else None
            p = lp[i] if i < len(lp) else None
            d = p - t if t is not None and p is not None else None
            print(f"| {i + 1} | {num(t, '.6f')} | {num(p, '.6f')} | {num(d, '+.2e')} |")
        print()


def spread(values: list[float], fmt=".2f") -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):{fmt}}x [{min(values):{fmt}}-"
            f"{max(values):{fmt}}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="gpt2,bert,vit")
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "pipetrain"),
                    help="the pipetrain executable")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch's threads")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per window for every model (default: gpt2 and bert 20, vit 12)")
    ap.add_argument("--scratch", default=os.environ.get(
        "PIPETRAIN_SCRATCH", str(Path.home() / ".cache" / "pipetrain-real-sizes")))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per window")
    ap.add_argument("--torch-attn", default="default", choices=["default", "eager", "sdpa"],
                    help="transformers' attention for the PyTorch windows")
    ap.add_argument("--torch-window", help=argparse.SUPPRESS)
    ap.add_argument("--gemm-window", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--metrics", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_window:
        torch_window(a)
        return
    if a.gemm_window:
        products.gemm_window(a.gemm_window, a.threads)
        return

    scratch = Path(a.scratch).expanduser().resolve()
    if str(scratch).startswith(str(ROOT) + os.sep):
        sys.exit(f"--scratch {scratch} is inside the repository; choose a folder outside it")
    scratch.mkdir(parents=True, exist_ok=True)
    binary = Path(a.bin).resolve()
    if not binary.exists():
        sys.exit(f"no pipetrain at {binary} (cargo build --release --features cli, or --bin)")
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            sys.exit(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    import torch
    import transformers

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"), host=os.uname().nodename,
        cpus=os.cpu_count(), torch=torch.__version__, transformers=transformers.__version__,
        pipetrain=str(binary), ort_dylib_path=os.environ.get("ORT_DYLIB_PATH"),
        torch_threads=a.threads, torch_attn=a.torch_attn, warmup_steps=WARMUP,
        exports={}, rounds=[])
    print(f"# pipetrain vs PyTorch eager at real sizes ({results['date']}; {os.cpu_count()} "
          f"CPUs; torch {torch.__version__}, transformers {transformers.__version__}; SGD "
          f"lr 1e-3, float32; PyTorch {a.threads} threads, pipetrain its own)\n", flush=True)
    configs = {}
    for m in models:
        print(f"exporting {m} into {scratch / m} ...", file=sys.stderr, flush=True)
        rec = export(m, scratch / m)
        results["exports"][m] = rec
        steps = a.steps or MODELS[m]["steps"]
        configs[m] = (pipetrain_config(m, scratch / m, steps), steps)
    print("| model | ONNX file | parameters (torch) | float initializer elements (ONNX) | "
          "nodes |")
    print("|---|---|---|---|---|")
    for m in models:
        e = results["exports"][m]
        print(f"| {m} | {e['onnx_file_bytes'] / 2**20:.0f} MiB | {e['torch_parameters']:,} | "
              f"{e['onnx_float_initializer_elements']:,} | {e['onnx_nodes']} |")
    print(flush=True)
    # The machine's GEMM rate at each model's layer shapes, on PyTorch's threads.
    results["gemm"] = {}
    for m in models:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--gemm-window", m,
                              "--threads", str(a.threads)], env=env, capture_output=True,
                             text=True, cwd=ROOT)
        try:
            results["gemm"][m] = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            print(f"{m}: GEMM rate not measured:\n{out.stderr[-1500:]}", file=sys.stderr)
    print("| model | GEMM rate, torch.matmul float32 on %d threads (best shape) | by shape |"
          % a.threads)
    print("|---|---|---|")
    for m, g in results["gemm"].items():
        by = ", ".join(f"{k}: {v:.0f}" for k, v in g["by_shape"].items())
        print(f"| {m} | {g['gemm_gflops']:.1f} GFLOP/s | {by} |")
    print(flush=True)
    work = scratch / "work"
    work.mkdir(exist_ok=True)
    for r in range(a.rounds):
        round_rec = {}
        for m in models:
            config, steps = configs[m]
            metrics = work / f"{m}.metrics.jsonl"
            print(f"round {r + 1}: {m}: PyTorch window ...", file=sys.stderr, flush=True)
            rec_t = run_window(
                [sys.executable, str(Path(__file__).resolve()), "--torch-window", m,
                 "--folder", str(scratch / m), "--metrics", str(metrics), "--steps",
                 str(steps), "--threads", str(a.threads), "--torch-attn", a.torch_attn],
                metrics, work, env, a.timeout, ROOT)
            try:
                rec_t["child"] = json.loads(rec_t["stdout_tail"].strip().splitlines()[-1])
            except (IndexError, ValueError):
                pass
            print(f"round {r + 1}: {m}: pipetrain window ...", file=sys.stderr, flush=True)
            rec_p = run_window([str(binary), "train", str(config), "--metrics", str(metrics)],
                               metrics, work, env, a.timeout, ROOT)
            round_rec[m] = dict(steps=steps, torch=rec_t, pipetrain=rec_p,
                                ratios=ratios(rec_p, rec_t))
            flops = rec_t.get("child", {}).get("product_flops")
            gflops = results["gemm"].get(m, {}).get("gemm_gflops")
            for rec in (rec_t, rec_p):
                rec["product_limit_share"] = products.share(flops, gflops,
                                                            rec.get("steps_per_s"))
            for who, rec in (("PyTorch", rec_t), ("pipetrain", rec_p)):
                if rec["rc"] != 0:
                    print(f"round {r + 1}: {m}: {who} failed (exit {rec['rc']}):\n"
                          f"{rec.get('error', '')}", file=sys.stderr, flush=True)
        results["rounds"].append(round_rec)
        (scratch / f"results-{stamp}.json").write_text(json.dumps(results, indent=1))
        print(f"## Round {r + 1}\n")
        print("| model | engine | time to first step (s) | steps/s (steps) | s/step | peak RSS "
              "(GiB) | loss at step 1 | loss at last step | product limit's share | status |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for m, x in round_rec.items():
            for who, rec in (("PyTorch", x["torch"]), ("pipetrain", x["pipetrain"])):
                sps = rec.get("steps_per_s")
                print(f"| {m} | {who} | {num(rec.get('time_to_first_step_s'), '.1f')} | "
                      f"{num(sps, '.3f')} ({rec.get('timed_steps', '-')}) | "
                      f"{num(1 / sps if sps else None, '.2f')} | "
                      f"{gib(rec.get('peak_rss_bytes'))} | {num(rec.get('loss_first'), '.5f')} | "
                      f"{num(rec.get('loss_last'), '.5f')} | "
                      f"{num(rec.get('product_limit_share'), '.0%')} | "
                      f"{'ok' if rec['rc'] == 0 else 'failed (exit %s)' % rec['rc']} |")
            q = x["ratios"]
            print(f"| {m} | pipetrain / PyTorch | {num(q.get('time_to_first_step_s'), '.2f')}x | "
                  f"{num(q.get('steps_per_s'), '.2f')}x | | "
                  f"{num(q.get('peak_rss_bytes'), '.2f')}x | max \\|loss diff\\| over steps: "
                  f"{num(q.get('max_abs_loss_diff'), '.1e')} | | | |")
        print()
        print_losses(round_rec)
        print(flush=True)
    print(f"## Summary over {a.rounds} round(s): pipetrain / PyTorch, median [min-max] of the "
          "per-round ratios\n")
    print("| model | steps/s | peak RSS | time to first step | steps/s: pipetrain, PyTorch | "
          "peak RSS GiB: pipetrain, PyTorch | time to first step s: pipetrain, PyTorch | "
          "max \\|loss diff\\| | product limit's share: pipetrain, PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for m in models:
        per = [rd[m] for rd in results["rounds"]]
        q = {k: [p["ratios"][k] for p in per if k in p["ratios"]] for k in
             ("steps_per_s", "peak_rss_bytes", "time_to_first_step_s", "max_abs_loss_diff")}

        def med(who, key):
            v = [p[who][key] for p in per if p[who].get(key) is not None and p[who]["rc"] == 0]
            return statistics.median(v) if v else None

        summary[m] = dict(ratios={k: dict(median=statistics.median(v), min=min(v), max=max(v))
                                  for k, v in q.items() if v},
                          rounds_ok=len(q["steps_per_s"]))
        del summary[m]["ratios"]["max_abs_loss_diff"]
        if q["max_abs_loss_diff"]:
            summary[m]["max_abs_loss_diff"] = max(q["max_abs_loss_diff"])
        print(f"| {m} | {spread(q['steps_per_s'])} | {spread(q['peak_rss_bytes'])} | "
              f"{spread(q['time_to_first_step_s'])} | "
              f"{num(med('pipetrain', 'steps_per_s'), '.3f')}, "
              f"{num(med('torch', 'steps_per_s'), '.3f')} | "
              f"{gib(med('pipetrain', 'peak_rss_bytes'))}, {gib(med('torch', 'peak_rss_bytes'))} | "
              f"{num(med('pipetrain', 'time_to_first_step_s'), '.1f')}, "
              f"{num(med('torch', 'time_to_first_step_s'), '.1f')} | "
              f"{num(summary[m].get('max_abs_loss_diff'), '.1e')} | "
              f"{num(med('pipetrain', 'product_limit_share'), '.0%')}, "
              f"{num(med('torch', 'product_limit_share'), '.0%')} |")
    results["summary"] = summary
    out = scratch / f"results-{stamp}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\nTime to first step: process start to the first line of its metrics file "
          f"(polled); steps/s over steps {WARMUP + 1}..N of each process's own clock. "
          f"Everything: {out}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
