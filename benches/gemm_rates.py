"""The machine's matrix-product rate at BERT-base's training shapes (1,024 tokens x 768 x
3,072), PyTorch (its CPU BLAS) against ONNX Runtime's MatMul and the FusedMatMul with a
transposed first operand that pipetrain's weight gradients use: what the products of a
real-size step can reach here.

    python benches/gemm_rates.py [--threads 2] [--repeats 10]

Needs torch, onnx and onnxruntime (tools/fixtures/requirements.txt). Prints GFLOP/s per
shape and engine (2 * M * K * N / time of one product, best of three means).
"""
import argparse
import time

import numpy as np


def mean_time(f, repeats):
    f()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            f()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best


def session(node, inputs, threads):
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h

    g = h.make_graph([node], "g", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info("c", T.FLOAT, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main():
    import torch
    from onnx import helper as h

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("| M x K x N | PyTorch A @ B | ONNX Runtime MatMul | PyTorch A^T @ B | "
          "ONNX Runtime FusedMatMul transA | ONNX Runtime Gemm transA |")
    print("|---|---|---|---|---|---|")
    for m, k, n in [(1024, 768, 3072), (1024, 3072, 768), (768, 1024, 3072)]:
        x = np.random.rand(m, k).astype(np.float32)
        y = np.random.rand(k, n).astype(np.float32)
        xt = np.ascontiguousarray(x.T)
        tx, ty, txt = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt)
        plain = session(h.make_node("MatMul", ["a", "b"], ["c"]), [("a", [m, k]), ("b", [k, n])],
                        a.threads)
        fused = session(h.make_node("FusedMatMul", ["a", "b"], ["c"], domain="com.microsoft",
                                    transA=1), [("a", [k, m]), ("b", [k, n])], a.threads)
        gemm = session(h.make_node("Gemm", ["a", "b"], ["c"], transA=1),
                       [("a", [k, m]), ("b", [k, n])], a.threads)
        rate = lambda s: 2 * m * k * n / s / 1e9  # noqa: E731
        cells = [
            rate(mean_time(lambda: tx @ ty, a.repeats)),
            rate(mean_time(lambda: plain.run(None, {"a": x, "b": y}), a.repeats)),
            rate(mean_time(lambda: txt.t() @ ty, a.repeats)),
            rate(mean_time(lambda: fused.run(None, {"a": xt, "b": y}), a.repeats)),
            rate(mean_time(lambda: gemm.run(None, {"a": xt, "b": y}), a.repeats)),
        ]
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{c:.0f} GFLOP/s" for c in cells) + " |")


if __name__ == "__main__":
    main()
