"""Model FLOPs of a GPT-style training step and the device's dense peak, for model
FLOPs utilization (MFU): PaLM's count (appendix B), 6 x parameters per token for the
products with the weights plus 12 x layers x d x sequence per token for attention's
two products, forward and backward; the peak is the vendor's dense figure for the
precision the products run in (float32 with TF32 off: the CUDA cores' FMA rate).
"""
import subprocess

# Dense TFLOP/s by device name fragment and precision (NVIDIA's data sheets: H100 SXM5
# and H200 share GH100's rates; "f32" is without TF32).
PEAKS = [
    ("H200", {"f32": 66.9, "bf16": 989.4, "f16": 989.4}),
    ("H100 80GB HBM3", {"f32": 66.9, "bf16": 989.4, "f16": 989.4}),
    ("H100 PCIe", {"f32": 51.2, "bf16": 756.0, "f16": 756.0}),
    ("A100", {"f32": 19.5, "bf16": 312.0, "f16": 312.0}),
]


def device_name():
    """The first GPU's name from nvidia-smi, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def peak_tflops(name, precision):
    """The dense peak of device `name` at `precision` (f32, bf16, f16), or None."""
    for fragment, peaks in PEAKS:
        if name and fragment in name:
            return peaks.get(precision)
    return None


def step_flops_per_token(params, layers, d, seq):
    """Model FLOPs a token of a training step costs (PaLM's count)."""
    return 6 * params + 12 * layers * d * seq


def mfu_text(tokens_per_s, params, layers, d, seq, precision, name=None):
    """'x TFLOP/s, MFU y% of DEVICE's z (precision)', or just the TFLOP/s where the
    device's peak is not known."""
    name = name or device_name()
    achieved = tokens_per_s * step_flops_per_token(params, layers, d, seq) / 1e12
    peak = peak_tflops(name, precision)
    if peak is None:
        return f"{achieved:.1f} model TFLOP/s (no peak known for {name or 'this device'})"
    return f"{achieved:.1f} model TFLOP/s, MFU {100 * achieved / peak:.1f}% of {name}'s {peak:g} ({precision})"
