"""PyTorch eager's GPT-2 step on the device, kernel by kernel: tokens/s over timed steps
(a second eager window beside gpt2_eager.py's), then torch.profiler over two steps, each
kernel's device time grouped as ncu_kernels.py groups pipetrain's.

    python3 eager_profile.py [--batch 4 --steps 20 --layers 12 --d 768 --heads 12 --seq 1024 --top 25]
"""
import collections
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpt2_eager import arguments, setup

PRODUCT = re.compile(r"gemm|gemv|xmma|cutlass|Kernel2|cublas|sm90_|sm80_|s1688|s16816", re.I)


def main():
    a = arguments([("top", 25)])
    model, opt, x, y, _ = setup(a)

    def step():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"pytorch eager (second window): {a.steps * a.batch * a.seq / dt:.0f} tokens/s, step {dt / a.steps * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    by = collections.defaultdict(lambda: [0, 0.0])
    total = products = 0.0
    count = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us() / 2  # per step
        short = re.sub(r"^void |[<(].*", "", e.name)[:70]
        by[short][0] += 1
        by[short][1] += us
        total += us
        count += 1
        if PRODUCT.search(e.name):
            products += us
    print(f"eager profile: {count // 2} kernels a step, {total / 1e3:.1f} ms on the device; matrix products "
          f"{products / 1e3:.1f} ms ({100 * products / max(total, 1):.0f}%), the rest {(total - products) / 1e3:.1f} ms")
    for short, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{us / 1e3:8.2f} ms {100 * us / total:5.1f}% {n // 2:5d}x  {short}")


if __name__ == "__main__":
    main()
