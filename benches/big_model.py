"""A Llama-shaped model of about 1 B parameters, too big to train with AdamW in one
capped process: random-initialized from seed 0 with transformers' LlamaForCausalLM,
exported as a user would (TorchScript exporter, opset 17, training mode, dynamic batch
and sequence axes). Its ~3.8 GB of float32 weights are over protobuf's 2 GB, so the
exporter writes them as external data files beside `model.onnx`.

Writes into FOLDER (default ~/.cache/pipetrain-big-model):
  model.onnx + one external data file per initializer
  data.npz      input_ids and labels (next tokens), STEPS x BATCH rows of SEQ tokens
  export.json   the recipe, parameter count, file sizes, export time

Usage: python benches/big_model.py [FOLDER]   (no network; torch, and transformers 4.46 or 5)
`benches/big_model.sh` runs it and then the capped runs.
"""
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import numpy as np

RECIPE = "1"  # bump to re-export
SEED = 0
STEPS, BATCH, SEQ = 8, 4, 64
CONFIG = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0,
)


def export(folder: Path) -> dict:
    record_path = folder / "export.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("recipe") == RECIPE and (folder / "model.onnx").exists():
            return record
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    cfg = transformers.LlamaConfig(use_cache=False, attn_implementation="eager", **CONFIG)
    model = transformers.LlamaForCausalLM(cfg).train()
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, CONFIG["vocab_size"], size=(STEPS * BATCH, SEQ + 1))
    data = dict(input_ids=tokens[:, :-1].astype(np.int64), labels=tokens[:, 1:].astype(np.int64))
    np.savez(folder / "data.npz", **data)
    # The graph's only input is input_ids: transformers 4.46's `num_logits_to_keep=0`
    # default would otherwise be traced as a second input.
    cls_forward = type(model).forward
    model.forward = lambda input_ids: cls_forward(
        model, input_ids=input_ids, use_cache=False, return_dict=False)
    args = (torch.from_numpy(data["input_ids"][:BATCH]),)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        try:
            import transformers.masking_utils  # noqa: F401  (transformers >= 5)

            # Its packed-sequence check traces aten::diff (no opset-17 symbolic); it
            # returns None for unpacked rows anyway, as the model is trained here.
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "fixtures"))
            import export_models as em

            stack.enter_context(em.no_packed_sequences())
        except ImportError:
            pass
        torch.onnx.export(model, args, str(folder / "model.onnx"), input_names=["input_ids"],
                          output_names=["logits"], dynamic_axes=axes, dynamo=False,
                          opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    files = [p for p in folder.iterdir() if p.is_file()]
    record = dict(
        recipe=RECIPE, config=CONFIG, steps=STEPS, batch=BATCH, seq=SEQ,
        torch=torch.__version__, transformers=transformers.__version__,
        parameters=sum(p.numel() for p in model.parameters()),
        model_onnx_bytes=(folder / "model.onnx").stat().st_size,
        external_files=len(files) - 2,
        total_bytes=sum(p.stat().st_size for p in files),
        export_s=round(time.perf_counter() - t0, 1),
    )
    record_path.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else
                  Path.home() / ".cache" / "pipetrain-big-model").expanduser()
    print(json.dumps(export(folder), indent=1))
