"""Shared definitions for the peer baselines (ONNX Runtime training API, PyTorch eager).

Everything that defines *what* is computed lives here: model shapes, parameter
names/layouts, initialisation, data generation, batch order, hyper-parameters.
numpy is the only hard dependency; torch / onnxruntime are imported lazily.
"""
from __future__ import annotations

import math
import os
import sys
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# What these scripts make lives in the repository's peers/ folder (the tests read it).
PEERS = HERE.parents[1] / "peers"
DATA = PEERS / "data"
RESULTS = PEERS / "results"
SCRATCH = Path(os.environ.get("PEERS_SCRATCH", Path.home() / ".cache" / "pipetrain-peers"))
ARTIFACTS = SCRATCH / "artifacts"

THREADS = 2
STEPS = 200
SEED = 20240917

# ----------------------------------------------------------------------------
# hyper-parameters of the reference curves
# ----------------------------------------------------------------------------
SGD_LR = 0.05
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OPTIMIZERS = ("sgd", "adamw")

# ----------------------------------------------------------------------------
# model configs
# ----------------------------------------------------------------------------
MLP = dict(d_in=784, hidden=512, n_classes=10, batch=64, n_samples=4096)
GPT = dict(vocab=512, d=128, n_layer=2, n_head=4, mlp_mult=4, seq=64, batch=8,
           n_seqs=512, ln_eps=1e-5)
MODELS = ("mlp", "tiny_gpt")


def batch_size(model: str) -> int:
    return MLP["batch"] if model == "mlp" else GPT["batch"]


# ----------------------------------------------------------------------------
# parameter specs: ordered (name, shape). Linear weights use the PyTorch layout
# [out_features, in_features]: y = x @ W.T + b.
# ----------------------------------------------------------------------------
def mlp_param_specs():
    d, h, c = MLP["d_in"], MLP["hidden"], MLP["n_classes"]
    return [
        ("fc1.weight", (h, d)), ("fc1.bias", (h,)),
        ("fc2.weight", (h, h)), ("fc2.bias", (h,)),
        ("fc3.weight", (c, h)), ("fc3.bias", (c,)),
    ]


def gpt_param_specs():
    V, d, T, L, m = GPT["vocab"], GPT["d"], GPT["seq"], GPT["n_layer"], GPT["mlp_mult"]
    specs = [("tok_emb.weight", (V, d)), ("pos_emb", (T, d))]
    for i in range(L):
        p = f"blocks.{i}."
        specs += [
            (p + "ln1.weight", (d,)), (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)), (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
            (p + "ln2.weight", (d,)), (p + "ln2.bias", (d,)),
            (p + "mlp.fc.weight", (m * d, d)), (p + "mlp.fc.bias", (m * d,)),
            (p + "mlp.proj.weight", (d, m * d)), (p + "mlp.proj.bias", (d,)),
        ]
    specs += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (V, d))]
    return specs


def param_specs(model: str):
    return mlp_param_specs() if model == "mlp" else gpt_param_specs()


def init_mlp(seed: int = SEED):
    """PyTorch-default-like init: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    rng = np.random.default_rng([seed, 1])
    out = {}
    for name, shape in mlp_param_specs():
        fan_in = shape[1] if len(shape) == 2 else out[name.replace("bias", "weight")].shape[1]
        bound = 1.0 / math.sqrt(fan_in)
        out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out


def init_gpt(seed: int = SEED):
    """GPT-2-like init: N(0, 0.02) weights/embeddings, residual projections
    N(0, 0.02/sqrt(2*n_layer)), zero biases, LayerNorm gamma=1 beta=0."""
    rng = np.random.default_rng([seed, 2])
    L = GPT["n_layer"]
    out = {}
    for name, shape in gpt_param_specs():
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            a = np.ones(shape)
        elif name.endswith(".bias"):
            a = np.zeros(shape)
        elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            a = rng.normal(0.0, 0.02 / math.sqrt(2 * L), size=shape)
        else:
            a = rng.normal(0.0, 0.02, size=shape)
        out[name] = a.astype(np.float32)
    return out


def init_params(model: str):
    return init_mlp() if model == "mlp" else init_gpt()


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
def batch_order(n: int, batch: int, steps: int, rng) -> np.ndarray:
    """[steps, batch] int32 sample indices: concatenated epoch permutations."""
    need = steps * batch
    idx = []
    while sum(len(p) for p in idx) < need:
        idx.append(rng.permutation(n))
    return np.concatenate(idx)[:need].reshape(steps, batch).astype(np.int32)


def make_mlp_data(seed: int = SEED):
    """x: [4096, 784] float32, values are multiples of 1/16 in [-4, 3.9375]
    (quantised N(0,1), exactly representable; keeps the .npz small).
    y: int64 labels = argmax of a fixed random teacher 784-64(tanh)-10."""
    rng = np.random.default_rng([seed, 3])
    n, d, c = MLP["n_samples"], MLP["d_in"], MLP["n_classes"]
    x = np.clip(np.round(rng.standard_normal((n, d)) * 16.0), -64, 63) / 16.0
    x = x.astype(np.float32)
    w1 = rng.standard_normal((d, 64)) / math.sqrt(d)
    b1 = 0.1 * rng.standard_normal(64)
    w2 = rng.standard_normal((64, c)) / math.sqrt(64)
    logits = np.tanh(x.astype(np.float64) @ w1 * 2.0 + b1) @ w2
    logits -= logits.mean(axis=0, keepdims=True)  # balance the classes
    y = logits.argmax(axis=1).astype(np.int64)
    order = batch_order(n, MLP["batch"], STEPS, rng)
    return dict(x=x, y=y, batch_idx=order)


def make_gpt_data(seed: int = SEED):
    """tokens: [512, 65] int64. Each row is a noisy repeating pattern: a random
    period p in [2, 8], a random pattern of p tokens drawn from the 512 vocab,
    repeated; each position is replaced by a uniform random token with prob 0.1.
    Model input is tokens[:, :64], target is tokens[:, 1:65]."""
    rng = np.random.default_rng([seed, 4])
    N, T, V = GPT["n_seqs"], GPT["seq"] + 1, GPT["vocab"]
    toks = np.empty((N, T), dtype=np.int64)
    t = np.arange(T)
    for i in range(N):
        p = int(rng.integers(2, 9))
        pat = rng.integers(0, V, size=p)
        row = pat[t % p]
        noise = rng.random(T) < 0.1
        row = np.where(noise, rng.integers(0, V, size=T), row)
        toks[i] = row
    order = batch_order(N, GPT["batch"], STEPS, rng)
    return dict(tokens=toks, batch_idx=order)


def load_params(model: str) -> dict:
    with np.load(DATA / f"{model}_init.npz") as z:
        return {k: z[k] for k in z.files}


def load_data(model: str) -> dict:
    with np.load(DATA / f"{model}_data.npz") as z:
        return {k: z[k] for k in z.files}


def get_batch(model: str, data: dict, step: int):
    """(input, labels) numpy arrays for `step` (wraps around batch_idx)."""
    idx = data["batch_idx"][step % len(data["batch_idx"])]
    if model == "mlp":
        return np.ascontiguousarray(data["x"][idx]), np.ascontiguousarray(data["y"][idx])
    seqs = data["tokens"][idx]
    return np.ascontiguousarray(seqs[:, :-1]), np.ascontiguousarray(seqs[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------
# torch models (same module is used for eager training and ONNX export)
# ----------------------------------------------------------------------------
def torch_model(model: str, params: dict | None = None, dtype=None):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MLPNet(nn.Module):
        def __init__(self):
            super().__init__()
            d, h, c = MLP["d_in"], MLP["hidden"], MLP["n_classes"]
            self.fc1 = nn.Linear(d, h)
            self.fc2 = nn.Linear(h, h)
            self.fc3 = nn.Linear(h, c)

        def forward(self, x):
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            d = GPT["d"]
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x, mask):
            B, T, C = x.shape
            H = GPT["n_head"]
            hd = C // H
            q, k, v = self.qkv(x).split(C, dim=2)
            q = q.view(B, T, H, hd).transpose(1, 2)
            k = k.view(B, T, H, hd).transpose(1, 2)
            v = v.view(B, T, H, hd).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att + mask  # additive causal mask: 0 on/below diagonal, -1e9 above
            att = torch.softmax(att, dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            return self.proj(y)

    class MLPBlock(nn.Module):
        def __init__(self):
            super().__init__()
            d, m = GPT["d"], GPT["mlp_mult"]
            self.fc = nn.Linear(d, m * d)
            self.proj = nn.Linear(m * d, d)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))  # exact (erf) GELU

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = GPT["d"]
            self.ln1 = nn.LayerNorm(d, eps=GPT["ln_eps"])
            self.attn = Attn()
            self.ln2 = nn.LayerNorm(d, eps=GPT["ln_eps"])
            self.mlp = MLPBlock()

        def forward(self, x, mask):
            x = x + self.attn(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            V, d, T = GPT["vocab"], GPT["d"], GPT["seq"]
            self.tok_emb = nn.Embedding(V, d)
            self.pos_emb = nn.Parameter(torch.zeros(T, d))
            self.blocks = nn.ModuleList([Block() for _ in range(GPT["n_layer"])])
            self.ln_f = nn.LayerNorm(d, eps=GPT["ln_eps"])
            self.head = nn.Linear(d, V, bias=False)
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
            self.register_buffer("attn_mask",
                                 torch.zeros(T, T).masked_fill(~causal, -1e9), persistent=False)

        def forward(self, tokens):
            B, T = tokens.shape
            x = self.tok_emb(tokens) + self.pos_emb
            mask = self.attn_mask.to(x.dtype)
            for blk in self.blocks:
                x = blk(x, mask)
            logits = self.head(self.ln_f(x))
            return logits.reshape(B * T, GPT["vocab"])  # [B*T, V] for the CE loss

    net = MLPNet() if model == "mlp" else TinyGPT()
    if params is not None:
        sd = {k: torch.from_numpy(np.array(v)) for k, v in params.items()}
        missing, unexpected = net.load_state_dict(sd, strict=True)
        names = sorted(n for n, _ in net.named_parameters())
        assert names == sorted(n for n, _ in param_specs(model)), names
    if dtype is not None:
        net = net.to(dtype)
    return net


# ----------------------------------------------------------------------------
# onnxruntime training API without importing torch
# ----------------------------------------------------------------------------
def import_ort_training_api(block_torch: bool = True):
    """Import onnxruntime.training.api (CheckpointState, Module, Optimizer)
    without running onnxruntime/training/__init__.py, which imports torch.
    The api sub-package itself only needs onnxruntime.capi. With block_torch
    the process cannot load torch at all, so its RSS is ORT's alone."""
    if block_torch and "torch" not in sys.modules:
        sys.modules["torch"] = None  # importlib.util.find_spec('torch') -> None
    import onnxruntime
    if "onnxruntime.training" not in sys.modules:
        pkg = types.ModuleType("onnxruntime.training")
        pkg.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
        sys.modules["onnxruntime.training"] = pkg
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    return onnxruntime, CheckpointState, Module, Optimizer


def ort_session_options(ort):
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return so


def artifact_dir(model: str, opt: str) -> Path:
    return ARTIFACTS / f"{model}_{opt}"


def rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0])
    return vals["VmRSS"], vals["VmHWM"]
