#!/usr/bin/env bash
# Fetch the cp312 wheels the GPU image lacks into .whl/ (git-ignored), for the device tool's `carry`.
# Run here (the registry is reachable from this machine, not from the GPU one), then:
#   device run: bash bench/gpu_run.sh KIND   with carry [".whl/xgr", ".whl/svc", ".whl/extra"]; add ".whl/fi"
#   (bench/fetch_flashinfer.sh) for --flashinfer, ".whl/ucx" for `2gpu pd` (the four folders ~41 MiB with libucx
#   trimmed below; all of .whl is over the 64 MiB a call carries)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
dl .whl/xgr xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2
dl .whl/extra jsonschema==4.26.0 jsonschema-specifications referencing rpds-py pytest-asyncio==1.5.0 \
  pytest-timeout==2.4.0
# The services' own imports the image may lack (the program benchmark runs the real gateway + worker).
dl .whl/svc prometheus-client==0.26.0 redis==8.1.0 requests==2.34.2 urllib3 idna certifi charset-normalizer \
  jinja2==3.1.6 markupsafe uvloop==0.23.0 orjson==3.13.0 msgspec==0.23.0
# UCX for the PD benchmark (bench/pd.py); the image already has cuda-bindings / cuda-core.
dl .whl/ucx ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0 \
  rapids-logger==0.3.0 nvidia-ml-py
# libucx without its static archives, perftest and programs (42 -> 17.5 MB; bench/wheel_trim.py), same file name.
python3 -m bench.wheel_trim libucx .whl/ucx/libucx_cu13-1.21.0-*.whl
# matplotlib for bench/workloads' ablation plot (the `bench` extra), in case the image lacks it.
dl .whl/bench matplotlib==3.10.8 contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
# py-spy for the benchmarks' --profile (bench/profile.py).
dl .whl/prof py-spy==0.4.3
du -sh .whl
