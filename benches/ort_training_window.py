"""One window of ONNX Runtime's training build training an exported model, for
benches/exported_side_by_side.py, which runs it in the peers' Python environment
(tools/peers: onnxruntime-training-cpu 1.19.2 with its torch).

The model is an opset-16 export (that build cannot differentiate LayerNormalization as
opset 17 writes it) whose first output is the logits as [rows, classes]. Artifacts come
from `generate_artifacts` (every float initializer trainable, mean softmax cross-entropy
with the family's ignore_index, SGD) the first time a folder is used. The window trains
`--steps` steps on batches of `--batch` rows of the data (cycled, as the other engines
take them) and prints the steps/s over the steps after `--warmup` as JSON.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime import training  # noqa: F401 - the training build's Python package
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module, Optimizer


def make_artifacts(model: Path, folder: Path, ignore_index: int | None) -> None:
    proto = onnx.load(str(model))
    floats = [i.name for i in proto.graph.initializer
              if i.data_type == onnx.TensorProto.FLOAT]
    folder.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(
        proto, requires_grad=floats, frozen_params=[],
        loss=onnxblock.loss.CrossEntropyLoss(ignore_index=ignore_index),
        optimizer=artifacts.OptimType.SGD, artifact_directory=folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--inputs", required=True, help="model inputs, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--ignore-index", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ort.set_default_logger_severity(3)
    if not (a.artifacts / "training_model.onnx").exists():
        make_artifacts(a.model, a.artifacts, a.ignore_index)

    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    state = CheckpointState.load_checkpoint(str(a.artifacts / "checkpoint"))
    module = Module(str(a.artifacts / "training_model.onnx"), state,
                    str(a.artifacts / "eval_model.onnx"), device="cpu", session_options=so)
    optimizer = Optimizer(str(a.artifacts / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(a.lr)
    module.train()

    data = dict(np.load(a.data))
    names = a.inputs.split(",")
    n = len(data["labels"])
    marks = []
    for step in range(a.steps):
        idx = [(step * a.batch + i) % n for i in range(a.batch)]
        feeds = [np.ascontiguousarray(data[k][idx]) for k in names]
        labels = np.ascontiguousarray(data["labels"][idx].reshape(-1))
        module(*feeds, labels)
        optimizer.step()
        module.lazy_reset_grad()
        marks.append(time.perf_counter())
    rate = (a.steps - a.warmup) / (marks[-1] - marks[a.warmup - 1])
    print(json.dumps({"steps_per_s": rate, "onnxruntime": ort.__version__}))


if __name__ == "__main__":
    main()
