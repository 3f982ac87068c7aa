"""Writes tests/fixtures/ort_gradient_cases.json, the cases of ONNX Runtime's own gradient
tests (orttraining/orttraining/test/gradient/gradient_ops_test.cc) that plain ONNX
expresses, in the form tests/it/grad_ort_cases.rs runs them (CI does not run this script).

Two steps, both from the repository root:

    python tools/ort_gradient_cases/transcription.py TRANSCRIPTION.json gradient_ops_test.cc
    python tools/ort_gradient_cases/fixture.py TRANSCRIPTION.json

`transcription.py` is a hand transcription of the C++ test file (microsoft/onnxruntime at
735e69a396af): every TEST block's op, opset, shapes, attributes, which inputs and outputs
are differentiated, and how the test makes its data, in words. The file itself is read only
for each block's line number. This script keeps the gradient checks of default-domain
operators that ONNX defines (ORT's contrib ops and its forward kernel tests left out; the
tests ORT disables as flaky kept) and writes, per case:

- the opset to build it at: the test's own from 17 on, else 17 (pipetrain handles opsets
  13 to 21); the attributes ONNX turned into inputs by then (Squeeze/Unsqueeze and
  ReduceSum `axes`) become constant inputs;
- each input's data as a generator the Rust test runs: explicit values, uniform floats in
  a range chosen from the test's data note (positive where it must be, away from zero
  where a kink is, distinct where ties matter), integer indices in the test's range,
  labels with every second one `ignore_index` where the test does that;
- typed attributes, the outputs whose gradients flow (the loss reads those), whether
  ONNX Runtime's test expects its builder to refuse the case, and the case's source line.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "ort_gradient_cases.json"
TARGET = 17
FLOAT_ATTRS = {"alpha", "beta", "epsilon", "cubic_coeff_a", "extrapolation_value", "ratio"}
# Attributes that are inputs at TARGET (ONNX moved them in opset 13).
TO_INPUT = {("Squeeze", "axes"): 1, ("Unsqueeze", "axes"): 1, ("ReduceSum", "axes"): 1}


def float_gen(i: dict) -> dict:
    if "values" in i:
        return {"values": [float(v) for v in i["values"]]}
    note = (i.get("data") or "").lower()
    if "|x| + 1" in note:
        return {"uniform": [1.0, 3.0]}
    if "|x| + 0.1" in note or "positive" in note:
        return {"uniform": [0.1, 2.0]}
    if "0.2" in note and ("no zeros" in note or "avoids 0" in note):
        return {"away_from_zero": 0.2}
    if "differ by" in note:
        # trunc(x * 100) / 100 + k * 0.002: the inputs of one case never tie.
        m = re.search(r"\+ (0\.\d+) applied", note)
        return {"grid": {"step": 0.01, "offset": float(m.group(1)) if m else 0.0}}
    if "distinct" in note:
        return {"distinct": 0.05}
    if "in [0, 2)" in note:
        return {"uniform": [0.05, 2.0]}
    if "uniform in [-1, 1]" in note:
        return {"uniform": [-1.0, 1.0]}
    if "class weights" in (i.get("note") or ""):
        return {"uniform": [0.5, 2.0]}
    return {"uniform": [-2.0, 2.0]}


def int_gen(i: dict, case: dict) -> dict:
    if "values" in i:
        return {"values": [int(v) for v in i["values"]]}
    note = i.get("data") or ""
    if "labels" in note:
        classes = case["inputs"][0]["shape"][1]
        m = re.search(r"ignore_index=(-?\d+)", note)
        return {"labels": {"classes": classes, "every_second": int(m.group(1)) if m else None}}
    m = re.search(r"in \[(-?\d+), (-?\d+)\)", note)
    if m:
        return {"ints": [int(m.group(1)), int(m.group(2))]}
    raise SystemExit(f"{case['id']}: no rule for integer data {note!r}")


def attribute(name: str, v) -> dict:
    if isinstance(v, str):
        return {"name": name, "s": v}
    if isinstance(v, list):
        kind = "floats" if name in FLOAT_ATTRS or any(isinstance(x, float) for x in v) else "ints"
        return {"name": name, kind: v}
    if name in FLOAT_ATTRS or isinstance(v, float):
        return {"name": name, "f": float(v)}
    return {"name": name, "i": int(v)}


def convert(case: dict) -> dict:
    opset = case["opset"] if case["opset"] >= TARGET else TARGET
    inputs = []
    for k, i in enumerate(case["inputs"]):
        dtype = i["dtype"]
        gen = {"bool": True} if dtype == "bool" else (
            int_gen(i, case) if dtype.startswith("int") else float_gen(i))
        inputs.append({"shape": i["shape"], "dtype": dtype, "grad": i["differentiated"],
                       "gen": gen})
    attrs = []
    for name, v in case["attributes"].items():
        slot = TO_INPUT.get((case["op"], name)) if case["opset"] < 13 else None
        if slot is not None:
            while len(inputs) < slot:
                inputs.append(None)
            inputs.insert(slot, {"shape": [len(v)], "dtype": "int64", "grad": False,
                                 "gen": {"values": v}})
            continue
        attrs.append(attribute(name, v))
    return {
        "id": case["id"],
        "op": case["op"],
        "opset": opset,
        "ort_opset": case["opset"],
        "inputs": inputs,
        "attributes": attrs,
        "outputs": [o["differentiated"] for o in case["output_info"]],
        "enabled_in_ort": case["enabled"],
        # ORT's test asserts its gradient builder refuses the case.
        "ort_refuses": any("EXPECTED FAILURE" in n for n in case["notes"]),
        "source": case["source"],
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    kept = [convert(c) for c in cases
            if c["kind"] == "gradient_check" and c["domain"] == "" and c["onnx_standard"]]
    rows = ",\n".join(json.dumps(c) for c in kept)
    OUT.write_text("[\n" + rows + "\n]\n")
    print(f"{len(kept)} of {len(cases)} cases -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
