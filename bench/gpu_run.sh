#!/usr/bin/env bash
# One device call of the benchmark suite: the carried wheels installed, then one kind. Results go to $OUT.
usage() {
  cat <<'EOF'
usage: bash bench/gpu_run.sh KIND [ARGS...]     (device tool, after bench/fetch_wheels.sh; carry [".whl/xgr",
       ".whl/svc", ".whl/extra"], with ".whl/fi" for --flashinfer and ".whl/ucx" for 2gpu pd (its four folders 41 MiB,
       libucx trimmed): all of .whl is over 64 MiB)

Each kind fits one 10-minute call on a fresh machine, its kernel compiles included. ARGS go to the kind's
benchmark (after its defaults, so a repeated flag wins). Results and logs: $OUT (default /tmp/out). LIMIT=SECONDS
caps each step's time limit, so that several kinds fit one call (LIMIT=250 bash bench/gpu_run.sh multiturn; ...).

  tests             GPU tests:  pytest -m gpu tests/ -k EXPR, a first ARG (default "not interpreted"), each named
  offline           bench.offline: batch-1 step, 256 x (512,128), prefill, radix zero-reuse (8 on/off pairs)
  kernels           bench.kernels: each kernel against eager torch / SDPA and the measured ceilings; then
                    bench.hicache: the host KV tier's load-back against a pinned host-to-device copy
  structured        bench.structured: jump-forward speed-up, grammar mask cost at batch 32
  serving           bench.serving: completions + generate, streamed and not, batch-1 TPOT, each against the
                    offline engine in the same call; a first ARG N runs at --stream-interval N (default 1):
                    `serving 16` shows the gateway's CPU at 16
  shared-prefix     bench.shared_prefix: hit rate and throughput of LPM / FCFS / radix off, cascade decode
  multiturn         bench.multiturn: conversations outgrowing a small GPU pool, host KV tier off then on
  programs          bench.workloads --ablations: the paper's workloads, radix / LPM / jump-forward / fork hint ablated
  fp8               GPU FP8 tests, then bench.fp8: FP8 / bf16 batch-1 step
  spec              bench.reference_models (~7 min at its defaults, in /tmp/refmodels; REF_ARGS shortens it), then
                    bench.spec in the time left
  2gpu              on 2 GPUs (nvidia-h100-x2), a first ARG of pd or tp:
                    `2gpu pd`: bench.pd, PD against unified workers
                    `2gpu tp`: GPU TP tests, then bench.tp: TP=2 / TP=1 batch-1 step
  ab                bench.ab: a benchmark alternated between knob settings, e.g.
                    ab base notma:RADIXSERVE_TMA_MIN_TOKENS=1000000 -- python3 -m bench.offline --skip-hf

--flashinfer (anywhere in ARGS; .whl/fi carried, from bench/fetch_flashinfer.sh): tests runs the FlashInfer backend's
GPU tests, kernels runs bench.attention (Triton vs FlashInfer vs SDPA), offline runs bench.backends (the engine on
its default backend against the engine on FlashInfer's), serving runs the servers and the offline engine on FlashInfer;
FlashInfer's JIT builds go to /tmp/fi-cache, which a later call on the same warm machine reuses.

docs/performance.md says what each measures and its goal; bench/RESULTS.md holds the current figures.
EOF
}
set -uo pipefail
kind=${1:-}
case $kind in
  tests|offline|kernels|structured|serving|shared-prefix|multiturn|programs|fp8|spec|2gpu|ab) shift ;;
  *) usage; exit 2 ;;
esac
FI=0; args=(); for a in "$@"; do if [[ $a == --flashinfer ]]; then FI=1; else args+=("$a"); fi; done; set -- "${args[@]}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
[[ -d .whl ]] || { echo "gpu_run.sh: no .whl here (bench/fetch_wheels.sh, then carry it)" >&2; exit 1; }
# Once per set of carried wheels on a machine (a second kind in the same call finds them installed).
stamp=/tmp/site/.carried-$(md5sum .whl/*/*.whl | md5sum | cut -c1-16)
[[ -e $stamp ]] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*/*.whl && touch "$stamp"; } || { echo "gpu_run.sh: the carried wheels did not install" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
[[ $FI == 0 ]] || { ls .whl/fi/*.whl >/dev/null 2>&1 && python3 -c "import flashinfer as f; print('flashinfer', f.__version__)"; } || { echo "gpu_run.sh: --flashinfer needs .whl/fi (bench/fetch_flashinfer.sh) importable" >&2; exit 1; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false UCX_WARN_UNUSED_ENV_VARS=n
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

# run SECONDS LOG CMD...: CMD under a time limit (LIMIT, when set and lower, caps it: several kinds in one call),
# its output kept whole in $OUT/LOG, its tail shown here.
run() {
  local limit=$1 log=$2; shift 2
  [[ -n ${LIMIT:-} ]] && (( LIMIT < limit )) && limit=$LIMIT
  timeout "$limit" "$@" 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/$log" | tail -"${TAIL:-25}"
}
# bench.spec after the reference models, in the time the call has left when that is enough (a warm machine keeps
# /tmp/refmodels; the device releases an idle one in seconds, so one call had better do both: REF_ARGS, e.g.
# "--target-minutes 2.5 --draft-minutes 0.6", shortens the training). Three minutes: bench.spec prints the speculation's
# verdicts before its last part (the 8B shape's engine and verification timing), which a shorter call may cut.
spec_after() {
  local left=$(( 585 - SECONDS ))
  if (( left < 180 )); then echo "gpu_run.sh spec: ${left}s left after training; call again (warm) for bench.spec"
  else run $left spec.log python3 -m bench.spec --models /tmp/refmodels --out "$OUT" "$@"; fi
}
# Modules importing what the GPU image lacks (openai, the e2e clients) fail to collect there and hold no GPU test:
# without the flag pytest stops at the first of them and runs nothing.
gpu_tests() { run "$1" "$2" python3 -m pytest -v -p no:cacheprovider -rfE --continue-on-collection-errors -m gpu tests/ -k "$3"; }

case $kind in
  tests) TAIL=30 gpu_tests 560 gpu_tests.log "${1:-$([[ $FI == 1 ]] && echo flashinfer || echo not interpreted)}" ;;
  offline)
    if [[ $FI == 1 ]]; then run 560 backends.log python3 -m bench.backends --out "$OUT" "$@"
    else run 560 offline.log python3 -m bench.offline --skip-hf --reuse-pairs 8 --out "$OUT" "$@"; fi ;;
  kernels)
    if [[ $FI == 1 ]]; then run 560 attention.log python3 -m bench.attention --out "$OUT" "$@"
    else
      run 400 kernels.log python3 -m bench.kernels --out "$OUT" "$@"
      run 120 hicache.log python3 -m bench.hicache --out "$OUT"
    fi ;;
  structured) run 500 structured.log python3 -m bench.structured --out "$OUT" "$@" ;;
  serving)
    interval=1
    if [[ ${1:-} =~ ^[0-9]+$ ]]; then interval=$1; shift; fi
    log=serving.log; [[ $interval == 1 ]] || log=serving_interval$interval.log
    run 560 "$log" python3 -m bench.serving --launch --num-prompts 256 --routes completions,generate --no-stream \
      --batch1 16 --offline --out "$OUT" $([[ $FI == 1 ]] && echo --attention-backend flashinfer) "$@" -- --stream-interval "$interval" ;;
  shared-prefix) run 560 shared_prefix.log python3 -m bench.shared_prefix --out "$OUT" "$@" ;;
  multiturn) TAIL=30 run 580 multiturn.log python3 -m bench.multiturn --out "$OUT" "$@" ;;
  programs)
    TAIL=60 run 580 workloads.log python3 -m bench.workloads --ablations --out "$OUT" --parallel 16 --instances 48 \
      --duration 5 --budget 540 "$@" ;;
  fp8)
    gpu_tests 200 fp8_tests.log "fp8 or quant"
    run 400 fp8.log python3 -m bench.fp8 --out "$OUT" "$@" ;;
  spec) run 540 reference_models.log python3 -m bench.reference_models --out /tmp/refmodels ${REF_ARGS:-} && spec_after "$@" ;;
  2gpu)
    case ${1:-} in
      pd) shift
        run 330 pd.log python3 -m bench.pd --out "$OUT" --duration 30 "$@"
        # Device-to-device pages failed: measure host staging too (UCX builds without CUDA transports).
        if grep -q 'failures [1-9]\|"errors": [1-9]' "$OUT/pd.log"; then
          run 200 pd_host.log python3 -m bench.pd --out "$OUT/host" --duration 30 --configs pd -- --kv-transfer-staging host
        fi ;;
      tp) shift
        # TP's parity tests run on whatever device is there (not marked gpu): here on the GPUs, over NCCL.
        run 200 tp_tests.log python3 -m pytest -q -p no:cacheprovider -rfE --continue-on-collection-errors tests/ \
          -k "test_tp and (engine_matches or families or kv_pages_leave_whole)"
        run 300 tp.log python3 -m bench.tp --out "$OUT" "$@" ;;
      *) echo "gpu_run.sh 2gpu: the first ARG is pd or tp" >&2; exit 2 ;;
    esac ;;
  ab) TAIL=40 run 560 ab.log python3 -m bench.ab --out "$OUT" "$@" ;;
esac
