#!/usr/bin/env bash
# Installs what pipetrain needs beside a Rust toolchain and Python 3, idempotently:
# - ONNX Runtime's shared library, from PyPI's onnxruntime wheel, into ./.venv (where
#   pipetrain looks for it; see `pipetrain doctor`);
# - the Python packages the tests use as independent readers of pipetrain's files:
#   `onnx` (its model checker), `safetensors` (checkpoint weight files) and `tensorboard`
#   (its own event-file reader, for the TensorBoard writer's tests);
# - OpenBLAS (PyPI scipy-openblas32), which runs the CPU's large float32 products where
#   it is faster than ONNX Runtime's own (`compute/blas`; pipetrain runs without it);
# - NVRTC (PyPI nvidia-cuda-nvrtc, CUDA 13), with which the tests compile the GPU path's
#   kernels on a machine without a GPU (`compute::cuda_state`; `.ci/run` requires it);
# - a C++ compiler (g++, from apt where none is found), with which the tests run the
#   same kernels' sources on the CPU (`compute/kernels/emu.rs`).
#
# - Intel MKL (PyPI mkl, 221 MB to download, 656 MB installed, without its OpenMP and
#   TBB: pipetrain runs it sequentially, one block per intra-op thread) where the CPU is
#   Intel's, on which the large products run faster still (`compute/blas`; pipetrain
#   prefers it to OpenBLAS when both are there: BERT-base 1.10x PyTorch eager's steps/s
#   against 0.99x on OpenBLAS). `--no-mkl` leaves it out, `--mkl` installs it on any CPU.
#
# `scripts/setup.sh --cuda` (a machine with an NVIDIA GPU) instead installs ONNX Runtime's
# CUDA build (PyPI onnxruntime-gpu, for CUDA 13) with the CUDA, cuDNN and NCCL wheels it
# needs into ./.venv-cuda, and writes .venv-cuda/pipetrain-env.sh, which sets
# ORT_DYLIB_PATH and LD_LIBRARY_PATH for a pipetrain built with `--features cuda`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--cuda" ]; then
  venv=.venv-cuda
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("onnxruntime-gpu") == "1.31.1"; m.version("nvidia-nccl-cu13")' 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      "onnxruntime-gpu[cuda,cudnn]==1.31.1" nvidia-nccl-cu13
  fi
  site=$(cd "$(ls -d "$venv"/lib/python3*/site-packages | head -n 1)" && pwd)
  lib=$(ls "$site"/onnxruntime/capi/libonnxruntime.so.* | head -n 1)
  # NCCL's wheel has libnccl.so.2 only; cudarc opens libnccl.so.
  mkdir -p "$venv/pipetrain-lib"
  links=$(cd "$venv/pipetrain-lib" && pwd)
  ln -sf "$(ls "$site"/nvidia/nccl/lib/libnccl.so.* | head -n 1)" "$links/libnccl.so"
  dirs=$links
  for d in "$site"/nvidia/*/lib; do dirs="$dirs:$d"; done
  {
    echo "export ORT_DYLIB_PATH=$lib"
    echo "export LD_LIBRARY_PATH=$dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  } > "$venv/pipetrain-env.sh"
  echo "setup: ONNX Runtime's CUDA build at $lib"
  echo "setup: now 'source $venv/pipetrain-env.sh' and build with 'cargo build --release --features cli,cuda'"
  exit 0
fi
if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq g++ >/dev/null
fi
venv=.venv
# name==version, one per line: what the project's venv must hold.
PACKAGES="onnxruntime==1.31.1
onnx==1.19.1
safetensors==0.6.2
tensorboard==2.21.0
scipy-openblas32==0.3.34.481.3
nvidia-cuda-nvrtc==13.2.86"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
missing=$(PACKAGES="$PACKAGES" "$venv/bin/python" - <<'EOF'
import importlib.metadata as m, os
for line in os.environ["PACKAGES"].split():
    name, version = line.split("==")
    try:
        ok = m.version(name) == version
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(line)
EOF
)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $missing
fi
lib=$(ls "$venv"/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n 1)
if [ -z "$lib" ]; then
  echo "setup: onnxruntime installed but libonnxruntime.so.* not found in $venv" >&2
  exit 1
fi
echo "setup: ONNX Runtime at $lib; python packages: $(echo $PACKAGES)"
mkl=auto
for arg in "$@"; do
  case $arg in
    --mkl) mkl=yes ;;
    --no-mkl) mkl=no ;;
  esac
done
if [ "$mkl" = auto ]; then
  if grep -q GenuineIntel /proc/cpuinfo 2>/dev/null; then mkl=yes; else mkl=no; fi
fi
if [ "$mkl" = yes ]; then
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("mkl") == "2026.2.0"' 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "mkl==2026.2.0"
  fi
  echo "setup: MKL at $(ls "$venv"/lib/libmkl_rt.so.* | head -n 1)"
fi
