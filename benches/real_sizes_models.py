"""The models, data, exports and pipetrain configs of `real_sizes.py` (see its docstring):
GPT-2 small, a BERT-base classifier and ViT-B/16, random-initialized from one seed, with
random batches, exported once into a scratch folder and reused while the recipe holds.
torch, transformers and torchvision are imported where a model is built or exported, so
that the PyTorch window's phases count them."""
import json
import time
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "1"  # bump to re-export
BATCHES = 20  # batches of data per model, cycled
SEED = 0

MODELS = {
    "gpt2": dict(batch=4, steps=20, desc="GPT-2 small, LM head, 4 x 128 tokens"),
    "bert": dict(batch=8, steps=20, desc="BERT-base classifier (2 labels), 8 x 128 tokens"),
    "vit": dict(batch=8, steps=12, desc="ViT-B/16, 1000 classes, 8 x 224 x 224"),
}
SEQ = 128


# ----------------------------------------------------------------------------- models


def build(name: str, attn: str | None = None):
    """(model, input names) of `name`, random-initialized from seed 0, train mode.
    `attn`: transformers' attention implementation (None: its default)."""
    import torch

    torch.manual_seed(SEED)
    if name == "vit":
        import torchvision

        model = torchvision.models.vit_b_16(num_classes=1000, dropout=0.0,
                                            attention_dropout=0.0)
        return model.train(), ["pixel_values"]
    import transformers

    # return_dict=False goes to the call (export below), not the config: transformers 5's
    # GPT2LMHeadModel reads its inner model's output by name, which a config-wide
    # return_dict=False turns into a tuple.
    kw = dict(use_cache=False)
    if attn is not None:
        kw["attn_implementation"] = attn
    if name == "gpt2":
        cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      summary_first_dropout=0.0, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bert":
        kw.pop("use_cache")
        cfg = transformers.BertConfig(num_labels=2, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0,
                                      classifier_dropout=0.0, **kw)
        model = transformers.BertForSequenceClassification(cfg)
    else:
        raise SystemExit(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return model.train(), ["input_ids"]


def make_data(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    rows = MODELS[name]["batch"] * BATCHES
    if name == "gpt2":
        tokens = rng.integers(0, 50257, size=(rows, SEQ + 1), dtype=np.int64)
        return dict(input_ids=tokens[:, :SEQ].copy(), labels=tokens[:, 1:].copy())
    if name == "bert":
        # 0-4: [PAD], [unused0-2], 100-103 are [UNK] [CLS] [SEP] [MASK]: any id works here.
        ids = rng.integers(1000, 30522, size=(rows, SEQ), dtype=np.int64)
        return dict(input_ids=ids, labels=rng.integers(0, 2, size=rows, dtype=np.int64))
    pixels = rng.standard_normal((rows, 3, 224, 224), dtype=np.float32)
    return dict(pixel_values=pixels, labels=rng.integers(0, 1000, size=rows, dtype=np.int64))


def rows_of(data: dict, step: int, batch: int) -> dict:
    """Step `step`'s rows, as pipetrain takes them: (step * batch + i) % rows."""
    n = len(data["labels"])
    idx = [(step * batch + i) % n for i in range(batch)]
    return {k: v[idx] for k, v in data.items()}


def export(name: str, folder: Path) -> dict:
    """Exports `name` into `folder` (model.onnx, init.pt, data.npz, model.toml) unless a
    complete export of this recipe is there; returns its record (export.json)."""
    record_path = folder / "export.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("recipe") == RECIPE and all(
                (folder / f).exists() for f in ("model.onnx", "init.pt", "data.npz")):
            return record
    import contextlib

    import onnx
    import torch

    sys.path.insert(0, str(ROOT / "tools" / "fixtures"))
    import export_models as em

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, inputs = build(name, attn=None if name == "vit" else "eager")
    torch.save(model.state_dict(), folder / "init.pt")
    data = make_data(name)
    np.savez(folder / "data.npz", **data)
    args = tuple(torch.from_numpy(rows_of(data, 0, MODELS[name]["batch"])[k]) for k in inputs)
    if name == "vit":
        axes = {"pixel_values": {0: "batch"}, "logits": {0: "batch"}}
    else:
        axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
        if name == "gpt2":
            axes["logits"][1] = "seq"
    with contextlib.ExitStack() as stack:
        if name != "vit":
            # forward(input_ids) only: transformers 5's `logits_to_keep=0` default would
            # otherwise become a graph input; and its packed-sequence check traces
            # aten::diff (no opset-17 symbolic). Neither changes the math.
            stack.enter_context(
                em.positional_forward(model, inputs, dict(return_dict=False)))
            try:
                import transformers.masking_utils  # noqa: F401  (transformers >= 5)

                stack.enter_context(em.no_packed_sequences())
            except ImportError:
                pass
        torch.onnx.export(model, args, str(folder / "model.onnx"), input_names=inputs,
                          output_names=["logits"], dynamic_axes=axes, dynamo=False,
                          opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    floats = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    record = dict(
        recipe=RECIPE, model=name, desc=MODELS[name]["desc"],
        torch=torch.__version__, onnx_file_bytes=(folder / "model.onnx").stat().st_size,
        torch_parameters=sum(p.numel() for p in model.parameters()),
        onnx_float_initializers=len(floats),
        onnx_float_initializer_elements=int(sum(np.prod(i.dims) for i in floats)),
        onnx_nodes=len(proto.graph.node),
        data_bytes=(folder / "data.npz").stat().st_size,
        export_s=round(time.perf_counter() - t0, 1),
    )
    record_path.write_text(json.dumps(record, indent=1))
    return record


def pipetrain_config(name: str, folder: Path, steps: int) -> Path:
    inputs = ["pixel_values"] if name == "vit" else ["input_ids"]
    feeds = ", ".join(f'{n} = "{n}"' for n in [*inputs, "labels"])
    text = (
        f'model_path = "{folder / "model.onnx"}"\nbatch_size = {MODELS[name]["batch"]}\n'
        f"num_train_steps = {steps}\ndisplay_loss_steps = 1000\n\n"
        '[loss]\nkind = "softmax_cross_entropy"\nprediction = "logits"\nlabel = "labels"\n\n'
        f'[data]\npath = "{folder / "data.npz"}"\n'
        f'layout = {{ kind = "arrays", feeds = {{ {feeds} }} }}\n\n'
        '[optimizer]\nkind = "sgd"\n\n[lr_schedule]\nkind = "constant"\nlr = 0.001\n'
    )
    path = folder / "model.toml"
    path.write_text(text)
    return path
