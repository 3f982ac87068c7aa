"""Export a `torch.nn.Module` to ONNX for training with pipetrain.

    from export_for_training import export_for_training
    export_for_training(model, (input_ids,), "model.onnx", input_names=["input_ids"],
                        output_names=["logits"],
                        dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                      "logits": {0: "batch", 1: "seq"}})

The export is the TorchScript exporter call of the README ("Models from PyTorch"):
`dynamo=False`, `training=TrainingMode.TRAINING`, `do_constant_folding=False`, so every
parameter stays its own initializer, named as in `model.named_parameters()` (a tied weight is
one initializer, named by one of its aliases). The file is left as torch wrote it; only
model-level `metadata_props` are added, each a JSON string, saying what the TorchScript
graph itself cannot:

  pipetrain.buffers       list of the float initializers that are torch buffers
                          (`named_buffers`: BART's `final_logits_bias`, Llama's `inv_freq`
                          where it is an initializer, BatchNorm running statistics). They
                          are state, not trained.
  pipetrain.frozen        list of the float initializers that are parameters with
                          `requires_grad == False` (Marian's sinusoidal
                          `embed_positions.weight`). Not trained.
  pipetrain.padding_rows  object {initializer: [rows]}: the `padding_idx` row (made
                          non-negative) of every `nn.Embedding` that has one; the lookup
                          gives that row no gradient, as in PyTorch.
  pipetrain.exporter      short string: this helper's name and version, torch's version,
                          the exporter and opset.

Torch tensors are matched to initializers in this order, the first that finds one wins:
  1. by name: any of the tensor's names (all aliases, `remove_duplicate=False`) is an
     initializer's name (how TorchScript names parameters and buffers);
  2. by identity: tensors sharing storage (`data_ptr`, shape, strides, dtype) form one alias
     group, and any name of the group is an initializer's name (tied weights that are
     distinct `Parameter` objects over one storage);
  3. by value: the one float initializer, not matched by 1 or 2, of the same shape whose
     value equals the tensor's; skipped when several are equal (every LayerNorm weight is
     ones at initialization, so a guess there could pick the wrong one).
A tensor that none of these finds (folded into a Constant node, or unused) is left out.
`export_for_training` returns the metadata and, under "matched_by", how each was found.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

__all__ = ["export_for_training", "VERSION"]
VERSION = "1"
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
           onnx.TensorProto.BFLOAT16}


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _match(model: torch.nn.Module, proto: onnx.ModelProto, base_dir: str,
           ) -> tuple[dict[int, str], dict[str, str]]:
    """{id(tensor): initializer} for every parameter and buffer found, and
    {initializer: "name" | "identity" | "value"}."""
    floats = {i.name: i for i in proto.graph.initializer if i.data_type in _FLOATS}
    names = {i.name for i in proto.graph.initializer}
    tensors: dict[int, torch.Tensor] = {}
    aliases: dict[int, list[str]] = {}
    groups: dict[tuple, list[int]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in tensors:
            tensors[id(t)] = t
            groups.setdefault(_storage_key(t), []).append(id(t))
        aliases.setdefault(id(t), []).append(name)
    found: dict[int, str] = {}
    how: dict[str, str] = {}
    for key, ids in aliases.items():  # 1. by name
        hit = next((n for n in ids if n in names), None)
        if hit is not None:
            found[key] = hit
            how.setdefault(hit, "name")
    for members in groups.values():  # 2. by identity
        hit = next((n for m in members for n in aliases[m] if n in names), None)
        for m in members:
            if hit is not None and m not in found:
                found[m] = hit
                how.setdefault(hit, "identity")
    claimed = set(found.values())
    values: dict[str, np.ndarray] = {}
    for key, t in tensors.items():  # 3. by value, unique candidates only
        if key in found or not t.is_floating_point():
            continue
        host = t.detach().cpu()
        candidates = []
        for n, init in floats.items():
            if n in claimed or tuple(init.dims) != tuple(host.shape):
                continue
            if n not in values:
                values[n] = numpy_helper.to_array(init, base_dir=base_dir)
            if np.array_equal(values[n], host.float().numpy().astype(values[n].dtype)):
                candidates.append(n)
        if len(candidates) == 1:
            found[key] = candidates[0]
            how[candidates[0]] = "value"
            claimed.add(candidates[0])
    return found, how


def training_metadata(model: torch.nn.Module, proto: onnx.ModelProto, base_dir: str = "",
                      exporter: str = "") -> dict[str, Any]:
    """The `pipetrain.*` entries for `proto` exported from `model` (as Python values), plus
    "matched_by": {initializer: how it was matched}."""
    found, how = _match(model, proto, base_dir)
    floats = {i.name for i in proto.graph.initializer if i.data_type in _FLOATS}
    buffers = sorted({found[id(b)] for _, b in model.named_buffers(remove_duplicate=False)
                      if id(b) in found and found[id(b)] in floats})
    frozen = sorted({found[id(p)] for _, p in model.named_parameters(remove_duplicate=False)
                     if not p.requires_grad and id(p) in found and found[id(p)] in floats})
    rows: dict[str, set[int]] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            init = found.get(id(module.weight))
            if init is not None:
                rows.setdefault(init, set()).add(module.padding_idx % module.num_embeddings)
    return {"pipetrain.buffers": buffers, "pipetrain.frozen": frozen,
            "pipetrain.padding_rows": {k: sorted(v) for k, v in sorted(rows.items())},
            "pipetrain.exporter": exporter, "matched_by": dict(sorted(how.items()))}


def export_for_training(model: torch.nn.Module, args: tuple[Any, ...] | torch.Tensor,
                        path: str | os.PathLike, *, input_names: Sequence[str] | None = None,
                        output_names: Sequence[str] | None = None,
                        dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
                        kwargs: dict[str, Any] | None = None, opset_version: int = 17,
                        ) -> dict[str, Any]:
    """Exports `model(*args, **kwargs)` to `path` with the TorchScript exporter in training
    mode and without constant folding, then adds the `pipetrain.*` metadata (see the module
    docstring). Returns that metadata as Python values, with "matched_by"."""
    path = os.fspath(path)
    if isinstance(args, torch.Tensor):
        args = (args,)
    torch.onnx.export(model, args, path, kwargs=kwargs, dynamo=False,
                      opset_version=opset_version,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=list(input_names) if input_names else None,
                      output_names=list(output_names) if output_names else None,
                      dynamic_axes=dict(dynamic_axes) if dynamic_axes else None)
    proto = onnx.load(path, load_external_data=False)  # external data stays where it is
    exporter = (f"export_for_training {VERSION}; torch {torch.__version__} TorchScript "
                f"exporter, opset {opset_version}, training, no constant folding")
    meta = training_metadata(model, proto, os.path.dirname(os.path.abspath(path)), exporter)
    kept = [p for p in proto.metadata_props if not p.key.startswith("pipetrain.")]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in meta.items():
        if key.startswith("pipetrain."):
            proto.metadata_props.add(
                key=key, value=value if isinstance(value, str) else json.dumps(value))
    onnx.save(proto, path)
    return meta
