#!/usr/bin/env bash
# Prepares, on a CPU machine, what a lent GPU machine needs for `benches/gpu/lease.sh`:
# pipetrain and the library's test executable built with `--features cli,cuda`, stripped,
# in .gpu/bin; ONNX Runtime's CUDA build (PyPI onnxruntime-gpu) xz-compressed and cut
# into .gpu/pNN parts small enough to travel one per call beside the checkout.
#   bash benches/gpu/pack.sh
# What it found on 2026-11-27: a call carries at most 64 MiB with the checkout, whose
# tracked files alone are ~50 MB (tests/fixtures 32 MB), so the parts of
# ../shared/tools/gpu-payload.sh (48 MiB) do not fit. Move tests/fixtures out of the
# checkout during the calls (`mv tests/fixtures /tmp/fixtures_hold`, and back after):
# the parts are sized for a checkout without it; .gpu/bin goes over in a call of its own.
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
ex="$(git rev-parse --git-dir)/info/exclude"; mkdir -p "$(dirname "$ex")"
grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"
mkdir -p .gpu
cargo build --release --features cli,cuda
lib=$(cargo test --release --lib --features cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    o = json.loads(l)
    if o.get("reason") == "compiler-artifact" and o.get("executable"): print(o["executable"])' | tail -1)
rm -rf .gpu/bin && mkdir -p .gpu/bin && cp target/release/pipetrain "$lib" .gpu/bin/ && strip .gpu/bin/*
ver=${ORT_GPU_VERSION:-1.31.1}
if [ ! -f .gpu/ort-$ver.tar.xz ]; then
  rm -rf .gpu/wheel .gpu/x
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 -d .gpu/wheel "onnxruntime-gpu==$ver"
  unzip -q -o .gpu/wheel/*.whl 'onnxruntime/capi/libonnxruntime*.so*' -d .gpu/x
  tar -C .gpu/x/onnxruntime/capi -cf - . | xz -T2 -6 > .gpu/ort-$ver.tar.xz.tmp
  mv .gpu/ort-$ver.tar.xz.tmp .gpu/ort-$ver.tar.xz
  rm -rf .gpu/wheel .gpu/x
fi
tree=$(git ls-files -z | grep -zv '^tests/fixtures/' | xargs -0 du -cb | tail -1 | cut -f1)
bin=$(du -sb .gpu/bin | cut -f1)
room=$(( (64 << 20) - tree - (2 << 20) ))
part=$room
[ "$part" -gt $((8 << 20)) ] || { echo "pack: the checkout ($tree bytes) leaves no room for parts" >&2; exit 1; }
rm -rf .gpu/p[0-9]*
split -b "$part" -d .gpu/ort-$ver.tar.xz .gpu/ort.part.
for p in .gpu/ort.part.*; do n=${p##*.}; mkdir -p ".gpu/p$n"; mv "$p" ".gpu/p$n/"; done
parts=$(ls -d .gpu/p[0-9]* | wc -l)
last=$(ls -d .gpu/p[0-9]* | tail -1)
echo "pack: checkout without tests/fixtures $((tree >> 20)) MiB, .gpu/bin $((bin >> 20)) MiB, $parts parts of up to $((part >> 20)) MiB"
echo "pack: mv tests/fixtures /tmp/fixtures_hold (back after); then these calls, back to back (idle > 30 s ends the lease):"
echo "  mkdir -p /tmp/ort /tmp/ptbin && cp .gpu/bin/* /tmp/ptbin/      carry [\".gpu/bin\"]"
for p in .gpu/p[0-9]*; do
  if [ "$p" = "$last" ]; then
    echo "  cp $p/* /tmp/ort/ && LEASE_BIN=/tmp/ptbin bash benches/gpu/lease.sh /tmp/gc; (copy what to keep to \$OUT)   carry [\"$p\"]"
  else
    echo "  cp $p/* /tmp/ort/                                               carry [\"$p\"]"
  fi
done
