"""The matrix-product limit of a real-size step, for benches/real_sizes.py: the step's
product FLOPs (counted by PyTorch's FlopCounterMode over one forward and backward of the
eager model: every mm, bmm, addmm, convolution and attention product) and the machine's
GEMM rate at the model's shapes (torch.matmul, float32, on the window's threads, best of
three timed runs per shape, measured in a process of its own in the same run). The limit
is the step's time if every product ran at that rate and nothing else took any; a
window's share of it is that time over its measured step time.
"""
import json
import time

# The products of a layer: (rows, inner, columns), rows = the tokens (or patches) a step
# takes, d = 768 for all three models: QKV/output projections and the MLP's two products.
def shapes(tokens: int, d: int = 768) -> list[tuple[int, int, int]]:
    return [(tokens, d, 3 * d), (tokens, d, d), (tokens, d, 4 * d), (tokens, 4 * d, d)]


TOKENS = {"gpt2": 4 * 128, "bert": 8 * 128, "vit": 8 * 197}


def gemm_window(model: str, threads: int) -> None:
    """Prints the best GFLOP/s of torch.matmul over `model`'s layer shapes (one JSON
    line)."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rates = {}
    for m, k, n in shapes(TOKENS[model]):
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            reps = 0
            while reps < 3 or time.perf_counter() - t < 0.3:
                torch.matmul(a, b)
                reps += 1
            best = min(best, (time.perf_counter() - t) / reps)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e9
    print(json.dumps(dict(gemm_gflops=max(rates.values()), by_shape=rates,
                          threads=torch.get_num_threads())), flush=True)


def count_flops(step) -> float:
    """FLOPs of the products `step()` runs (a forward and backward), by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


def share(flops, gflops, steps_per_s):
    """The product limit's share of a step: (FLOPs at the GEMM rate) / (measured step)."""
    if not (flops and gflops and steps_per_s):
        return None
    return flops / (gflops * 1e9) * steps_per_s
