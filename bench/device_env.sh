# Sourced by the device scripts (gpu_run.sh, ab.sh): the carried wheels (.whl/, from bench/fetch_wheels.sh)
# installed into /tmp/site and put on the paths, and the environment every benchmark runs with. Returns
# non-zero if the wheels do not install.
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || return 1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false UCX_WARN_UNUSED_ENV_VARS=n
