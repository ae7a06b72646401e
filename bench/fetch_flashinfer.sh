#!/usr/bin/env bash
# FlashInfer for the GPU machine: the pinned flashinfer-python wheel, repacked without the JIT sources an
# attention / sampling / norm backend never builds (bench/flashinfer_wheel.py; docs/kernels.md says what goes
# and why), into .whl/fi/ (.gitignore has .whl/). Its one dependency the GPU image lacks, apache-tvm-ffi, is
# bench/fetch_wheels.sh's (.whl/xgr: one version of each wheel, or pip refuses the set), so run that first.
# Then, device run: bash bench/gpu_run.sh KIND --flashinfer ...   with carry [".whl/xgr", ".whl/svc", ".whl/extra",
# ".whl/fi"]. FlashInfer compiles its kernels on first use there (paged decode ~10 s, sm90 prefill ~60 s) into
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (gpu_run.sh: /tmp/fi-cache), which a warm machine reuses.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.7.4  # torch 2.11 + CUDA 13 (JIT: no binary to match), sm90 decode / FA2 / FA3 prefill
ls .whl/xgr/apache_tvm_ffi-*.whl >/dev/null 2>&1 \
  || { echo "fetch_flashinfer.sh: run bench/fetch_wheels.sh first (apache-tvm-ffi comes with .whl/xgr)" >&2; exit 1; }
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d "$src" "flashinfer-python==$VERSION"
rm -rf .whl/fi
python3 -m bench.flashinfer_wheel "$src"/flashinfer_python-"$VERSION"-py3-none-any.whl .whl/fi
du -sh .whl/fi
