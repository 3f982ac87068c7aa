"""Training steps/s of pipetrain on the exported Hugging Face fixtures (BERT masked LM,
ViT; tests/fixtures/models) against PyTorch eager training the same model, in windows
that alternate (torch, pipetrain, torch, pipetrain, ...), each ratio taken within one
round so that drift between minutes does not land in it.

Each round, for a family:
  - a PyTorch window: the family's model as tools/fixtures/export_models.py builds it
    (float32, train mode, torch.optim.SGD, 2 threads), 300 steps on batches of `--batch`
    rows of the fixture's data; steps/s over steps 21-300;
  - a pipetrain window: `pipetrain train` of the fixture's model.onnx (the TorchScript
    export) with the same optimizer, batch and data, 300 steps; steps/s over steps
    21-300 from its metrics file.

The fixtures are small (hidden sizes of 32 to 64): the ratios say how much each engine
spends around the arithmetic, not what it reaches on large layers.

Run by benches/exported_side_by_side.sh, which makes the Python environment.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "fixtures"))
import export_models as em  # noqa: E402

BIN = ROOT / "target" / "release" / "pipetrain"
STEPS, WARMUP = 300, 20


def rows(fam, step: int, batch: int) -> dict:
    """Rows of step `step` (the data's 80 rows, cycled)."""
    n = len(fam.data["labels"])
    idx = [(step * batch + i) % n for i in range(batch)]
    return {k: v[idx] for k, v in fam.data.items()}


def torch_window(fam, batch: int) -> float:
    model = em.copy.deepcopy(fam.model).train()
    opt = torch.optim.SGD(model.parameters(), lr=fam.lr_sgd)
    marks = []
    for step in range(STEPS):
        b = rows(fam, step, batch)
        loss = em.loss_of(em.forward(fam, model, b), b["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        marks.append(time.perf_counter())
    return (STEPS - WARMUP) / (marks[-1] - marks[WARMUP - 1])


def pipetrain_config(fam, batch: int, scratch: Path) -> Path:
    folder = ROOT / "tests" / "fixtures" / "models" / fam.name
    feeds = ", ".join(f'{n} = "{n}"' for n in [*fam.inputs, "labels"])
    ignore = f"ignore_index = {fam.ignore_index}\n" if fam.ignore_index is not None else ""
    text = (
        f'model_path = "{folder / "model.onnx"}"\nbatch_size = {batch}\n'
        f"num_train_steps = {STEPS}\ndisplay_loss_steps = 1000\n\n"
        f'[loss]\nkind = "softmax_cross_entropy"\nprediction = "logits"\nlabel = "labels"\n{ignore}\n'
        f'[data]\npath = "{folder / "data.npz"}"\n'
        f'layout = {{ kind = "arrays", feeds = {{ {feeds} }} }}\n\n'
        f'[optimizer]\nkind = "sgd"\n\n[lr_schedule]\nkind = "constant"\nlr = {fam.lr_sgd}\n'
    )
    path = scratch / f"{fam.name}.toml"
    path.write_text(text)
    return path


def pipetrain_window(config: Path, scratch: Path) -> float:
    metrics = scratch / "metrics.jsonl"
    out = subprocess.run([str(BIN), "train", str(config), "--metrics", str(metrics)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pipetrain: {out.stderr[-2000:]}")
    t = {r["step"]: r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines())}
    return (STEPS - WARMUP) / (t[STEPS] - t[WARMUP])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--families", default="bert,vit")
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(2)
    scratch = Path(tempfile.mkdtemp(prefix="exported_side_by_side_"))
    print(f"\n## pipetrain train vs PyTorch eager on the exported fixtures, {a.rounds} "
          f"alternating rounds, batch {a.batch}, SGD, 2 threads ({time.strftime('%Y-%m-%d')}; "
          f"torch {torch.__version__}, transformers {em.transformers.__version__})\n")
    print("| model | pipetrain / PyTorch: median [min-max] | pipetrain steps/s | PyTorch steps/s |")
    print("|---|---|---|---|")
    for name in a.families.split(","):
        fam = em.FAMILIES[name]()
        config = pipetrain_config(fam, a.batch, scratch)
        ratios, ours, theirs = [], [], []
        for r in range(a.rounds):
            t = torch_window(fam, a.batch)
            p = pipetrain_window(config, scratch)
            ratios.append(p / t)
            ours.append(p)
            theirs.append(t)
            print(f"{name} round {r}: torch {t:.1f}, pipetrain {p:.1f} steps/s",
                  file=sys.stderr, flush=True)
        print(f"| {name} | {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] "
              f"| {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} |")


if __name__ == "__main__":
    main()
