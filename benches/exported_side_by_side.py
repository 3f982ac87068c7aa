"""Training steps/s of pipetrain on exported Hugging Face and torchvision models against
PyTorch eager and ONNX Runtime's training build training the same model, in windows that
alternate (torch, pipetrain, ORT, torch, pipetrain, ORT, ...), each ratio taken within
one round so that drift between minutes does not land in it.

The models are tools/fixtures/export_models.py's families (small, random-initialized:
hidden sizes of 16 to 64), plus DistilBERT (masked LM, built here the same way). Each is
exported by torch.onnx.export as the fixtures are (TorchScript, opset 17, training mode,
no constant folding) for pipetrain, and at opset 16 for ONNX Runtime's training build,
which cannot differentiate LayerNormalization as opset 17 writes it; its logits are
reshaped to [rows, classes] there for its loss block.

Each round, for a family:
  - a PyTorch window: the family's model (float32, train mode, torch.optim.SGD, `--threads`
    threads, default 2),
    300 steps on batches of `--batch` rows of the family's data (its 80 rows, cycled);
    steps/s over steps 21-300;
  - a pipetrain window: `pipetrain train` of the opset-17 export with the same optimizer,
    batch and data, 300 steps; steps/s over steps 21-300 from its metrics file;
  - an ONNX Runtime window (when `--ort-python` names the peers' Python, which
    benches/exported_side_by_side.sh makes): benches/ort_training_window.py, 300 steps,
    steps/s over steps 21-300.

The models are small: the ratios say how much each engine spends around the arithmetic,
not what it reaches on large layers. Each engine may use `--threads` threads: PyTorch and
ONNX Runtime's training build are given that many; pipetrain chooses its own within the
machine's cores (one on these models: their kernels are too small to share) unless fewer
are asked for, when its `runtime.intra_op_threads` is set to that.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "fixtures"))
import export_models as em  # noqa: E402

BIN = ROOT / "target" / "release" / "pipetrain"
STEPS, WARMUP = 300, 20


def distilbert() -> em.Family:
    """DistilBERT masked LM at the fixtures' BERT size, on BERT's data."""
    rng = np.random.default_rng(em.DATA_SEED)
    data = em.masked_lm_data(rng, pad_id=0, mask_id=em.BERT_MASK_ID, low=5)
    cfg = dict(vocab_size=em.VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
               max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=0)
    axes = {**em.TEXT_AXES, "attention_mask": {0: "batch", 1: "seq"}}
    return em.hf_family("distilbert", transformers.DistilBertForMaskedLM,
                        transformers.DistilBertConfig, cfg, data,
                        ["input_ids", "attention_mask"], axes, ["logits"],
                        ignore_index=em.IGNORE_INDEX)


def lstm_ptb() -> em.Family:
    """Zaremba et al.'s medium PTB language model at its size (vocabulary 10,000, embedding
    and hidden 650, two LSTM layers, 35 steps, batch 20 by `--batch`): 19.8 M parameters,
    on random tokens (the speed does not depend on them)."""
    vocab, width, seq, rows = 10_000, 650, 35, 200
    torch.manual_seed(em.WEIGHT_SEED)
    model = em.RecurrentLM([torch.nn.LSTM(width, width, num_layers=2, batch_first=True)],
                           width, vocab=vocab, embed=width)
    tokens = np.random.default_rng(em.DATA_SEED).integers(0, vocab, (rows, seq + 1))
    data = dict(input_ids=tokens[:, :seq].copy(), labels=tokens[:, 1:].copy())
    return em.Family(name="lstm_ptb", library="torch.nn", cls="RecurrentLM",
                     construction="PTB medium", config={}, model=model, data=data,
                     inputs=["input_ids"], dynamic_axes=em.TEXT_AXES,
                     output_names=["logits"], lr_sgd=1.0)


FAMILIES = {**em.FAMILIES, "distilbert": distilbert, "lstm_ptb": lstm_ptb}


def rows(fam, step: int, batch: int) -> dict:
    """Rows of step `step` (the data's rows, cycled)."""
    n = len(fam.data["labels"])
    idx = [(step * batch + i) % n for i in range(batch)]
    return {k: v[idx] for k, v in fam.data.items()}


def torch_window(fam, batch: int) -> float:
    model = copy.deepcopy(fam.model).train()
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


def export(fam, path: Path, opset: int) -> Path:
    entry = em.export(fam, path, **{**em.TS_EXPORT, "opset_version": opset})
    if not entry["ok"]:
        sys.exit(f"{fam.name}: export at opset {opset} failed: {entry['error']}")
    return path


def flat_logits(path: Path, classes: int) -> Path:
    """The model with its first output (the logits) reshaped to [rows, classes]."""
    m = onnx.load(str(path))
    logits = m.graph.output[0]
    if len(logits.type.tensor_type.shape.dim) == 2:
        return path
    shape = onnx.numpy_helper.from_array(np.array([-1, classes], np.int64), "flat_shape")
    m.graph.initializer.append(shape)
    m.graph.node.append(onnx.helper.make_node("Reshape", [logits.name, "flat_shape"],
                                              ["flat_logits"]))
    flat = onnx.helper.make_tensor_value_info("flat_logits", onnx.TensorProto.FLOAT,
                                              ["rows", classes])
    m.graph.output.insert(0, flat)
    m.graph.output.remove(logits)
    out = path.with_name(path.stem + ".flat.onnx")
    onnx.save(m, str(out))
    return out


def pipetrain_config(fam, model: Path, data: Path, batch: int, threads: int,
                     scratch: Path) -> Path:
    feeds = ", ".join(f'{n} = "{n}"' for n in [*fam.inputs, "labels"])
    ignore = f"ignore_index = {fam.ignore_index}\n" if fam.ignore_index is not None else ""
    text = (
        f'model_path = "{model}"\nbatch_size = {batch}\n'
        f"num_train_steps = {STEPS}\ndisplay_loss_steps = 1000\n\n"
        f'[loss]\nkind = "softmax_cross_entropy"\nprediction = "logits"\nlabel = "labels"\n{ignore}\n'
        f'[data]\npath = "{data}"\n'
        f'layout = {{ kind = "arrays", feeds = {{ {feeds} }} }}\n\n'
        f'[optimizer]\nkind = "sgd"\n\n[lr_schedule]\nkind = "constant"\nlr = {fam.lr_sgd}\n'
    )
    if threads < (os.cpu_count() or 1):
        text += f"\n[runtime]\nintra_op_threads = {threads}\n"
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


def ort_window(python: str, fam, model: Path, data: Path, batch: int, threads: int,
               scratch: Path) -> float:
    args = [python, str(ROOT / "benches" / "ort_training_window.py"), "--model", str(model),
            "--artifacts", str(scratch / f"{fam.name}_ort"), "--data", str(data),
            "--inputs", ",".join(fam.inputs), "--batch", str(batch), "--steps", str(STEPS),
            "--warmup", str(WARMUP), "--lr", str(fam.lr_sgd), "--threads", str(threads)]
    if fam.ignore_index is not None:
        args += ["--ignore-index", str(fam.ignore_index)]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ONNX Runtime training ({fam.name}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["steps_per_s"]


def ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    global STEPS, WARMUP
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--families", default="bert,distilbert,vit,convnext")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=STEPS, help="steps a window")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="steps not timed")
    ap.add_argument("--ort-python", default=None,
                    help="a Python with onnxruntime-training (the peers'); none: no ORT column")
    a = ap.parse_args()
    STEPS, WARMUP = a.steps, a.warmup
    torch.set_num_threads(a.threads)
    scratch = Path(tempfile.mkdtemp(prefix="exported_side_by_side_"))
    ort = a.ort_python
    print(f"\n## pipetrain train vs PyTorch eager{' and ONNX Runtime training' if ort else ''} "
          f"on exported models, {a.rounds} alternating rounds of {STEPS} steps, batch "
          f"{a.batch}, SGD, {a.threads} threads ({time.strftime('%Y-%m-%d')}; torch {torch.__version__}, "
          f"transformers {transformers.__version__})\n")
    print("Ratios: median [min-max] over rounds of pipetrain's steps/s over the peer's.\n")
    print("| model | vs PyTorch | vs ORT training | vs the faster | pipetrain | PyTorch | ORT "
          "training (steps/s) |")
    print("|---|---|---|---|---|---|---|")
    for name in a.families.split(","):
        fam = FAMILIES[name]()
        folder = scratch / name
        folder.mkdir()
        data = folder / "data.npz"
        np.savez(data, **fam.data)
        config = pipetrain_config(fam, export(fam, folder / "model.onnx", 17), data, a.batch,
                                  a.threads, scratch)
        if ort:
            classes = em.forward(fam, copy.deepcopy(fam.model), fam.batch(0)).shape[-1]
            ort_model = flat_logits(export(fam, folder / "model16.onnx", 16), classes)
        per = {"torch": [], "ours": [], "ort": []}
        for r in range(a.rounds):
            per["torch"].append(torch_window(fam, a.batch))
            per["ours"].append(pipetrain_window(config, scratch))
            if ort:
                per["ort"].append(ort_window(ort, fam, ort_model, data, a.batch, a.threads,
                                            scratch))
            print(f"{name} round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in per.items()
                                                    if v) + " steps/s",
                  file=sys.stderr, flush=True)
        ours = per["ours"]
        vs_torch = [p / t for p, t in zip(ours, per["torch"])]
        vs_ort = [p / o for p, o in zip(ours, per["ort"])]
        vs_best = [p / max(t, o) for p, t, o in zip(ours, per["torch"], per["ort"])]
        med = lambda v: f"{statistics.median(v):.1f}" if v else "-"  # noqa: E731
        print(f"| {name} | {ratio(vs_torch)} | {ratio(vs_ort) if vs_ort else '-'} | "
              f"{ratio(vs_best) if vs_best else '-'} | {med(ours)} | {med(per['torch'])} | "
              f"{med(per['ort'])} |", flush=True)


if __name__ == "__main__":
    main()
