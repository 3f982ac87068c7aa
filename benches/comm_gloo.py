"""The peer side of `cargo bench --bench comm`: PyTorch's gloo backend (what
torch.distributed uses on CPU) timing the same all-reduces and the same 1 MB hop as
pipetrain's TCP transport, one process per rank on loopback.

    python benches/comm_gloo.py RANK WORLD PORT SIZES_BYTES(comma) ITERS(comma)

Rank 0 prints one line per measurement: `allreduce BYTES SECONDS` (median of the
iterations, after one warm-up) and, with two ranks, `hop BYTES SECONDS` (half the median
round trip of a send/recv ping-pong).
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4].split(",")]
    iters = [int(s) for s in sys.argv[5].split(",")]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    gen = torch.Generator().manual_seed(rank)
    for size, n in zip(sizes, iters):
        buf = torch.rand(size // 4, generator=gen, dtype=torch.float32)
        times = []
        for i in range(n + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if i > 0:
                times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"allreduce {size} {statistics.median(times)}", flush=True)
    if world == 2:
        hop = torch.zeros(1 << 18, dtype=torch.float32)
        times = []
        for i in range(21):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(hop, 1)
                dist.recv(hop, 1)
            else:
                dist.recv(hop, 0)
                dist.send(hop, 0)
            if i > 0:
                times.append((time.perf_counter() - start) / 2)
        if rank == 0:
            print(f"hop {hop.numel() * 4} {statistics.median(times)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
