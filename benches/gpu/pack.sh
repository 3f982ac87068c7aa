#!/usr/bin/env bash
# Prepares, on a CPU machine, what a lent GPU machine needs for `benches/gpu/lease.sh`:
# pipetrain and the library's test executable built with `--features cli,cuda`, stripped,
# in .gpu/bin; ONNX Runtime's CUDA build (PyPI onnxruntime-gpu) xz-compressed and cut
# into .gpu/pNN parts small enough to travel one per call beside the checkout.
#   bash benches/gpu/pack.sh
# What it found on 2026-11-27: a call carries at most 64 MiB with the checkout, whose
# tracked files alone are ~50 MB (tests/fixtures 32 MB, peers 13 MB), so the parts of
# ../shared/tools/gpu-payload.sh (48 MiB) do not fit. The folders in PACK_HOLD (default
# "tests/fixtures peers"; keep peers for lease.sh's curves, resume and precision checks)
# stay out of the checkout during the calls (pack.sh prints how), and the binaries and
# ONNX Runtime travel as one payload cut into parts sized for what is left: 4 calls.
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
hold=${PACK_HOLD:-tests/fixtures peers}
pattern=$(printf '^%s/\\|' $hold); pattern=${pattern%\\|}
tree=$(git ls-files -z | grep -zv "$pattern" | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( (64 << 20) - tree - (2 << 20) ))
[ "$room" -gt $((8 << 20)) ] || { echo "pack: the checkout ($tree bytes) leaves no room for parts" >&2; exit 1; }
rm -rf .gpu/p[0-9]* .gpu/payload.tar
tar -C .gpu -cf .gpu/payload.tar bin "ort-$ver.tar.xz"
split -b "$room" -d .gpu/payload.tar .gpu/payload.part.
rm .gpu/payload.tar
for p in .gpu/payload.part.*; do n=${p##*.}; mkdir -p ".gpu/p$n"; mv "$p" ".gpu/p$n/"; done
parts=$(ls -d .gpu/p[0-9]* | wc -l)
last=$(ls -d .gpu/p[0-9]* | tail -1)
echo "pack: checkout without ($hold) $((tree >> 20)) MiB, $parts parts of up to $((room >> 20)) MiB"
echo "pack: for f in $hold; do mkdir -p /tmp/pack_hold/\$(dirname \$f); mv \$f /tmp/pack_hold/\$f; done  (and back after);"
echo "pack: then these calls, back to back (idle > 30 s ends the lease):"
for p in .gpu/p[0-9]*; do
  if [ "$p" = "$last" ]; then
    echo "  mkdir -p /tmp/pl && cp $p/* /tmp/pl/ && bash benches/gpu/lease.sh /tmp/gc; cp /tmp/gc/*.txt /tmp/gc/*.log \$OUT/   carry [\"$p\"]"
  else
    echo "  mkdir -p /tmp/pl && cp $p/* /tmp/pl/                carry [\"$p\"]"
  fi
done
