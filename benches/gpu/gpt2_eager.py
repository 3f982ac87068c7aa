"""PyTorch eager's side of the GPT-2 small comparison: the same model as pipetrain's
built-in `gpt2` (12 layers, d 768, 12 heads, vocabulary 50257, context 1024, untied head,
no dropout), float32 with TF32 off, plain SGD, random tokens; prints tokens/s. With
`--autocast bf16|f16` the forward runs under `torch.autocast` (what pipetrain's
`use_mixed_precision` matches), parameters float32, a gradient scaler for float16.

    python3 gpt2_eager.py --batch B --steps N [--layers 12 --d 768 --heads 12 --seq 1024]
                          [--autocast bf16|f16]
"""
import argparse
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def arguments(extra=()):
    """The command line: the model's shape and batch (and `extra` (name, default) ints)."""
    ap = argparse.ArgumentParser()
    for k, v in [("batch", 4), ("steps", 20), ("layers", 12), ("d", 768), ("heads", 12),
                 ("seq", 1024), ("vocab", 50257), *extra]:
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--autocast", choices=["bf16", "f16"])
    ap.add_argument("--mfu-params", type=float,
                    help="parameters to count model FLOPs with (as gpt2_speed.py is given)")
    return ap.parse_args()


def setup(a):
    """pipetrain's built-in `gpt2` in PyTorch (float32, TF32 off), plain SGD, and one
    batch of random tokens: (model, optimizer, inputs, targets, device)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.d, n_head=a.heads, n_positions=a.seq,
                     vocab_size=a.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT2LMHeadModel(cfg).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev, generator=g)
    return model, opt, tokens[:, :-1], tokens[:, 1:], dev


def main():
    a = arguments()
    model, opt, x, y, dev = setup(a)

    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(a.autocast)
    scaler = torch.amp.GradScaler(enabled=a.autocast == "f16")

    def step():
        with torch.autocast(dev, dtype=half or torch.float32, enabled=half is not None):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    dt = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    what = f", autocast {a.autocast}" if half else ""
    print(f"pytorch eager{what}: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, {params / 1e6:.1f} M parameters, "
          f"batch {a.batch} x {a.seq}, {a.steps} steps in {dt:.2f} s: "
          f"{a.steps * a.batch * a.seq / dt:.0f} tokens/s, loss {loss.item():.4f}")
    if a.mfu_params and dev == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from peak import mfu_text
        tps = a.steps * a.batch * a.seq / dt
        print(f"pytorch eager{what}: " + mfu_text(tps, a.mfu_params, a.layers, a.d, a.seq,
                                                   a.autocast or "f32", torch.cuda.get_device_name()))


if __name__ == "__main__":
    main()
