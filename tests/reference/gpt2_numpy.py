"""GPT-2's forward pass in numpy (float64), written from the GPT-2 paper and Hugging
Face's GPT2LMHeadModel, not from pipetrain's graph: the reference `tests/it/models.rs`
compares pipetrain's ONNX GPT-2 (run by ONNX Runtime) against.

usage: gpt2_numpy.py MODEL.onnx TOKENS.npz OUT.npy HEADS
Reads the weights from the model's initializers (Hugging Face names and layouts), the
int64 array `tokens` [B, T] of TOKENS.npz, and writes the logits [B*T, vocab] to OUT.npy.
"""
import sys

import numpy as np
import onnx
from onnx import numpy_helper

model_path, tokens_path, out_path, heads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
W = {
    t.name: numpy_helper.to_array(t).astype(np.float64)
    for t in onnx.load(model_path).graph.initializer
}
tokens = np.load(tokens_path)["tokens"]
B, T = tokens.shape
layers = len({k.split(".")[1] for k in W if k.startswith("h.")})


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * W[p + ".weight"] + W[p + ".bias"]


def gelu(x):  # GPT-2's tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def linear(x, p):  # Conv1D: x @ W + b, W [in, out]
    return x @ W[p + ".weight"] + W[p + ".bias"]


x = W["wte.weight"][tokens] + W["wpe.weight"][:T]
causal = np.tril(np.ones((T, T), dtype=bool))
for i in range(layers):
    p = f"h.{i}."
    q, k, v = np.split(linear(layer_norm(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
    D = q.shape[-1]
    dh = D // heads
    q, k, v = (t.reshape(B, T, heads, dh).transpose(0, 2, 1, 3) for t in (q, k, v))
    s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh), -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    y = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
    x = x + linear(y, p + "attn.c_proj")
    h = gelu(linear(layer_norm(x, p + "ln_2"), p + "mlp.c_fc"))
    x = x + linear(h, p + "mlp.c_proj")
x = layer_norm(x, "ln_f")
head = W.get("lm_head.weight", W["wte.weight"])  # tied: the token embedding
np.save(out_path, x.reshape(B * T, -1) @ head.T)
