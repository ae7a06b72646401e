#!/usr/bin/env bash
# One device call: install carried wheels, GPU smoke tests, then the benchmarks. Logs go to $OUT.
# Usage (device tool, carry [".whl"], after bench/fetch_wheels.sh here):
#   bash bench/gpu_run.sh prefill-tma|two-row-final|two-row-next|rows-final|two-row-tiles|two-row-tiles-fp8|trace-b2|lm-head-rows|bf16-rows|fp8-rows|fp8-rows-64|fp8-rows-pdl|ideas|gate-up|long-extend|fp8-h200|fp8-down|fp8-rope|tput-layout|kv-fp8|kv-fp8-tput|fp8-block|fp8-block-e2e|tests|offline|offline-nohf|kernels|structured|programs|workloads|pd|pd-decode-heavy|fp8|serving|serving-interval|serving-warm|serving-dp|serving-dp4|sync-audit|probes|b1-attn|recheck|recheck-a|recheck-b|l2-prefetch|batch1-next|batch1-all|batch1-next-trace|fp8-row|tp|shared-prefix|all
# recheck: issues 12 and 14 single-GPU goals, FP8 and non-streaming serving included, in one call (~7 min; 2026-12-04), after a change to a measured path
# (pd wants the nvidia-h200-x2 kind: one GPU per worker)
# Done 12-06 15:07-15:25 (H100): recheck-a twice, recheck-b, kernels at c0ab0f1 (NEW_KV_TMA on; every goal PASS against
# the sustained matmul rate). Pending on an H200 (an H100 came for every call since 12-05 but one): `recheck`,
# `prefill-tma`, `fp8-h200`, `bf16-rows`, `two-row-tiles` and `two-row-tiles-fp8`.
# Carry [".whl/xgr", ".whl/svc", ".whl/extra"].
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
[[ -d .whl ]] || { echo "gpu_run.sh: no .whl here (bench/fetch_wheels.sh, then carry it)" >&2; exit 1; }
source bench/device_env.sh || exit 1
# Module knobs of the batch-1 ideas, as bench.b1 --variants takes them. Since 2026-12-05 both (and
# --decode-rope-fusion) are the defaults: batch1-next/batch1-all then compare them against themselves; A/B them
# with =0 (bench/RESULTS.md, "Batch-1 ideas measured, three adopted").
KV=@kernels.attention.triton_decode.KV_BEFORE_WAIT=1; FOLD=@shared.models.llama.FOLD_FINAL_NORM=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == all || $what == tests ]]; then
  # A fresh machine compiles every kernel first: 240 s stopped the run after 20 tests (2026-12-04).
  timeout 480 python3 -m pytest -q -p no:cacheprovider -k "not interpreted" tests/test_kernels.py tests/test_engine.py \
    tests/test_engine_grammar.py tests/test_grammar_overlap.py tests/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == all || $what == offline || $what == offline-nohf ]]; then
  extra=""; [[ $what == offline-nohf ]] && extra="--skip-hf"
  timeout 400 python3 -m bench.offline --out "$OUT" $extra 2>&1 | tee "$OUT/offline.log" | tail -40
fi
if [[ $what == all || $what == kernels ]]; then
  timeout 200 python3 -m bench.kernels 2>&1 | tee "$OUT/kernels.log" | tail -40
fi
if [[ $what == structured ]]; then
  timeout 300 python3 -m bench.structured --out "$OUT" 2>&1 | tee "$OUT/structured.log" | tail -20
fi
if [[ $what == programs ]]; then
  timeout 570 python3 -m bench.programs --out "$OUT" 2>&1 | tee "$OUT/programs.log" | tail -20
fi
if [[ $what == shared-prefix ]]; then
  timeout 480 python3 -m bench.shared_prefix --out "$OUT" 2>&1 | tee "$OUT/shared_prefix.log" | tail -20
fi
if [[ $what == pd ]]; then
  timeout 330 python3 -m bench.pd --out "$OUT" --duration 30 2>&1 | tee "$OUT/pd.log" | tail -12
  # If device-to-device pages failed, measure host staging too (UCX builds without CUDA transports).
  if grep -q 'failures [1-9]\|"errors": [1-9]' "$OUT/pd.log"; then
    timeout 200 python3 -m bench.pd --out "$OUT/host" --duration 30 --configs pd -- --kv-transfer-staging host \
      2>&1 | tee "$OUT/pd_host.log" | tail -12
  fi
fi
if [[ $what == fp8 ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quantization.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -5
  timeout 400 python3 -m bench.fp8 --out "$OUT" 2>&1 | tee "$OUT/fp8.log" | tail -10
fi
if [[ $what == serving ]]; then
  timeout 500 python3 -m bench.serving --launch --num-prompts 256 --routes generate,completions --no-stream --profile --batch1 16 \
    --offline --out "$OUT" 2>&1 | tee "$OUT/serving.log" | tail -14
fi
if [[ $what == serving-interval ]]; then
  # The same workload with --stream-interval 16 (16 tokens per streamed increment): the gateway's
  # per-token CPU when events carry several tokens (issue 12's <= 5 us/token goal).
  timeout 300 python3 -m bench.serving --launch --num-prompts 256 --routes completions,generate --offline \
    --out "$OUT/interval16" -- --stream-interval 16 2>&1 | tee "$OUT/serving_interval.log" | tail -10
fi
if [[ $what == serving-warm ]]; then
  # The burst with its connections opened beforehand (as a load balancer's or an SDK's pool holds them)
  # against the default cold burst, on one stack: what of the arrival is the client's connection set-up.
  timeout 300 python3 -m bench.serving --launch --num-prompts 256 --routes completions,generate --repeat 2 --offline \
    --out "$OUT/cold" -- --stream-interval 16 2>&1 | grep -v Capturing | tee "$OUT/serving_cold.log" | tail -8
  timeout 200 python3 -m bench.serving --launch --num-prompts 256 --routes completions,generate --repeat 2 \
    --warm-connections --out "$OUT/warm" -- --stream-interval 16 2>&1 | grep -v Capturing | tee "$OUT/serving_warm.log" | tail -6
fi
if [[ $what == serving-dp ]]; then
  # Data-parallel scaling (nvidia-h200-x2): one unified worker vs two behind one gateway, 512 streams.
  timeout 400 python3 -m bench.serving --launch --num-prompts 512 --routes completions --workers-sweep 1,2 \
    --out "$OUT/dp" 2>&1 | tee "$OUT/serving_dp.log" | tail -8
fi
if [[ $what == serving-dp4 ]]; then
  # Data-parallel scaling on nvidia-h200-x4 (goal >= 3.7x): 1, 2 and 4 unified workers, at the default
  # --stream-interval 1, behind a pool of two gateway processes.
  timeout 580 python3 -m bench.serving --launch --num-prompts 1024 --routes completions --workers-sweep 1,2,4 \
    --out "$OUT/dp4" -- --gateway-processes 2 2>&1 | tee "$OUT/serving_dp4.log" | tail -10
fi
if [[ $what == tp ]]; then
  # Tensor parallelism (nvidia-h200-x2): parity with TP=1 on the GPUs (NCCL, CUDA graphs), then speed.
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tp.py -k "engine_matches or families or kv_pages_leave_whole" 2>&1 \
    | tee "$OUT/tp_tests.log" | tail -5
  timeout 300 python3 -m bench.tp --out "$OUT" 2>&1 | tee "$OUT/tp.log" | tail -8
fi
if [[ $what == prefill-tma ]]; then
  # Prefill attention's new-token k/v by TMA (kernels.attention.triton_extend's NEW_KV_TMA, on since 2026-12-06):
  # CUDA checks, the no-prefix sweep against cuDNN, then the prefill goal's workload in the engine, pointer loads
  # against TMA (~2 min on a fresh machine).
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and extend_attention_tma" 2>&1 | tail -3
  timeout 380 python3 -m bench.probe prefill_attn_tma 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/prefill_tma.log" | tail -60
fi
# recheck = recheck-a then recheck-b. A fresh machine compiles every kernel first and the whole ran past one call's
# 600 s (2026-12-06): on a fresh machine run the halves as two calls, back to back (the machine stays warm 30 s).
if [[ $what == recheck || $what == recheck-a ]]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_quantization.py -k gpu 2>&1 | tee "$OUT/recheck_tests.log" | tail -3
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels.py -k "cuda_bf16 and (gemv or extend)" 2>&1 \
    | tee -a "$OUT/recheck_tests.log" | tail -3
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_engine.py -k "bf16 or cuda_graphs" 2>&1 \
    | tee -a "$OUT/recheck_tests.log" | tail -3
  # Eight cache off/on pairs: the zero-reuse overhead's goal (0.3%) is below one run's spread; with three
  # pairs it read 0.66% and 0.31% where ten read 0.21% (2026-12-04).
  # With the mixed-chunk A/B (two pairs of throughput runs, 2026-12-05): one more info line.
  timeout 240 python3 -m bench.offline --out "$OUT" --skip-hf --reuse-pairs 8 2>&1 | tee "$OUT/offline.log" | tail -12
fi
if [[ $what == recheck || $what == recheck-b ]]; then
  timeout 200 python3 -m bench.fp8 --out "$OUT" 2>&1 | grep -v Capturing | tee "$OUT/fp8.log" | tail -8
  timeout 150 python3 -m bench.structured --out "$OUT" 2>&1 | grep -v Capturing | tee "$OUT/structured.log" | tail -12
  timeout 240 python3 -m bench.serving --launch --num-prompts 256 --routes completions,generate --no-stream --batch1 16 --offline \
    --out "$OUT/interval16" -- --stream-interval 16 2>&1 | grep -v Capturing | tee "$OUT/serving_interval.log" | tail -12
fi
if [[ $what == fp8-rows ]]; then
  # FP8 weights at decode batches of 2..64: the GEMV's several-row tensor-core tile with FP8 weights widened to bf16
  # (weight-only; the default up to 16 rows since 2026-12-06) against W8A8 (per-token quantization +
  # torch._scaled_mm), per linear (with a tile sweep at 8 rows) and as decode steps at batch 1..64. CUDA checks first.
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and (gemv_fp8_rows or gemv_fp8_codes)" 2>&1 | tail -3
  timeout 430 python3 -m bench.probe fp8_small_m fp8_batches 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/fp8_rows.log" | tail -40
fi
if [[ $what == fp8-rows-64 ]]; then
  # FP8 weight-only GEMVs past 16 rows (tensor-core tiles of 32 and 64 rows; GEMV_MAX_M_FP8 = 64) against the default
  # (16: W8A8 past it); bf16 weights on the same several-row GEMV up to 16 rows (GEMV_MAX_M = 16: cuBLAS past one
  # row by default, a batch-2 step 1.20x batch 1's on an H100, 12-06); decode steps at batch 1..64 on this card. ~4 min.
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and gemv_fp8_rows" 2>&1 | tail -2
  timeout 360 python3 -c "
import bench.probe as P
P.probe_fp8_batches({}, variants={'bf16': (None, {}), 'bf16_rows16': (None, {'kernels.ops.GEMV_MAX_M': 16}),
                        'fp8': ('fp8', {}), 'fp8_64': ('fp8', {'kernels.ops.GEMV_MAX_M_FP8': 64}),
                        'fp8_w8a8': ('fp8', {'kernels.ops.GEMV_MAX_M_FP8': 1})}, batches=(1, 2, 8, 16, 24, 32, 48, 64))
" 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/fp8_rows_64.log" | tail -10
fi
if [[ $what == rows-final ]]; then
  # rows-next / rows-next2's picks (H100, 12-06 07:05-07:15; bench/RESULTS.md) as the defaults: two rows on the one-row
  # kernel, rope + KV store in qkv's epilogue at 2-16 rows (bf16), the MLP gated in gate_up's epilogue at 2-16 rows
  # (FP8); split K by tickets at several rows removed. CUDA checks and the engine tests of the knobs, then decode steps
  # at batch 1-16, bf16 and FP8, the defaults against the former ones (all three off), alternated twice. ~5 min.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "(cuda_bf16 and (gemv_two_rows or gemv_rope_store_rows or gemv_gated_out or splitk_tickets or gemv_rows)) or bf16_rows or fp8_rows_gated" 2>&1 | tail -4
  timeout 280 python3 -c "
import bench.probe as P
L = 'shared.models.llama.'
off = {'kernels.gemv.TWO_ROW_KERNEL': False, L + 'ROPE_EPILOGUE_ROWS': False, L + 'GATE_UP_EPILOGUE_ROWS_FP8': False}
v = {}
for r in ('', '_again'):
    v.update({'bf16' + r: (None, {}), 'bf16_former' + r: (None, off), 'fp8' + r: ('fp8', {}), 'fp8_former' + r: ('fp8', off)})
P.probe_fp8_batches({}, variants=v, batches=(1, 2, 4, 8, 16), swept=False)
" 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/rows_final.log" | tail -6
fi
if [[ $what == two-row-next ]]; then
  # Two rows on the one-row kernel, round two (built 12-06 08:00-09:00 without a GPU, knobs off; sm_90 compiles
  # without spills): FP8 weights there too (kernels.gemv.TWO_ROW_KERNEL_FP8: FP8 batch 2 was 1.38x batch 1, the
  # tensor-core tile's GEMVs +784 us and 96 reduce launches in the trace), the rope / gating epilogues on it
  # (TWO_ROW_EPILOGUES: bf16 batch 2's qkv left it for the rope epilogue) and the split residual norms
  # (TWO_ROW_NORMS: bf16 batch 2's 65 norm launches, 232 us). CUDA checks, then decode steps at batch 1, 2 and 4,
  # alternated twice. ~8 min. Since 2e77ff2 (12-06 09:45) all three are the defaults, so these variants compare the
  # defaults with themselves: two-row-final A/Bs them against their former values.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "(cuda_bf16 and (gemv_two_rows or gemv_two_row_epilogues or gemv_two_row_norms)) or bf16_rows or fp8_rows_gated" 2>&1 | tail -4
  timeout 330 python3 -c "
import bench.probe as P
G, L = 'kernels.gemv.', 'shared.models.llama.'
ep, f2, nm = {G + 'TWO_ROW_EPILOGUES': True}, {G + 'TWO_ROW_KERNEL_FP8': True}, {G + 'TWO_ROW_NORMS': True}
gated = {L + 'GATE_UP_EPILOGUE_ROWS': True}
v = {}
for r in ('', '_again'):
    v.update({'bf16' + r: (None, {}), 'bf16_ep' + r: (None, ep), 'bf16_ep_norms' + r: (None, {**ep, **nm}),
              'bf16_ep_norms_gated' + r: (None, {**ep, **nm, **gated}), 'fp8' + r: ('fp8', {}),
              'fp8_two' + r: ('fp8', f2), 'fp8_two_ep' + r: ('fp8', {**f2, **ep}),
              'fp8_two_ep_norms' + r: ('fp8', {**f2, **ep, **nm})})
P.probe_fp8_batches({}, variants=v, batches=(1, 2, 4), swept=False)
" 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/two_row_next.log" | tail -4
fi
if [[ $what == two-row-tiles ]]; then
  # kernels.gemv.TWO_ROW_KERNEL's tiles swept at 2 rows per linear (bench.probe two_row_tiles), then decode steps at
  # batch 1-4 at two_row_config's rule and at the sweep's best against the default, alternated twice. ~5 min.
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and gemv_two_rows" 2>&1 | tail -2
  timeout 450 python3 -m bench.probe two_row_tiles 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/two_row_tiles.log" | tail -20
fi
if [[ $what == two-row-final ]]; then
  # two-row-next's picks (H100, 12-06 09:33; bench/RESULTS.md) as the defaults: FP8 two rows on the one-row kernel, the
  # rope / gating epilogues and the split norms on it, bf16 two rows gated there. CUDA checks and the engine tests of
  # the knobs, then decode steps at batch 1-16, bf16 and FP8, the defaults against the former ones (all five off),
  # alternated twice. ~6 min.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "(cuda_bf16 and (gemv_two_rows or gemv_two_row_epilogues or gemv_two_row_norms or gemv_gated_out)) or bf16_rows or fp8_rows_gated" 2>&1 | tail -4
  timeout 280 python3 -c "
import bench.probe as P
G, L = 'kernels.gemv.', 'shared.models.llama.'
off = {G + 'TWO_ROW_KERNEL_FP8': False, G + 'TWO_ROW_EPILOGUES': False, G + 'TWO_ROW_NORMS': False,
       L + 'GATE_UP_EPILOGUE_TWO_ROWS': False}
v = {}
for r in ('', '_again'):
    v.update({'bf16' + r: (None, {}), 'bf16_former' + r: (None, off), 'fp8' + r: ('fp8', {}), 'fp8_former' + r: ('fp8', off)})
P.probe_fp8_batches({}, variants=v, batches=(1, 2, 4, 8, 16), swept=False)
" 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/two_row_final.log" | tail -6
fi
if [[ $what == two-row-tiles-fp8 ]]; then
  # The same for FP8 weights under kernels.gemv.TWO_ROW_KERNEL_FP8 (on since 12-06 09:33): its tiles swept at 2 rows per
  # linear (bench.probe two_row_tiles_fp8), then decode steps at batch 1-4: the FP8 default (the knob at
  # TWO_ROW_TILES_FP8's tiles, swept 12-06 09:38), the sweep's best and the tensor-core tile, alternated twice. ~5 min.
  timeout 450 python3 -m bench.probe two_row_tiles_fp8 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/two_row_tiles_fp8.log" | tail -20
fi
if [[ $what == trace-b2 ]]; then
  # bf16 batch 2's decode replay kernel by kernel beside batch 1's (PDL on): where the second row's 0.68 ms goes
  # (H100, 12-06: 5.87 against 5.19 ms), before any several-row fusion is built. ~2 min.
  # With FP8 too since 12-06 07:30 (after the several-row defaults: two-row kernel, rope and FP8 gating epilogues). ~4 min.
  timeout 420 python3 -m bench.probe ${TRACE_B2:-trace_pdl_b2 trace_pdl_b2_fp8} 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/trace_b2.log" | tail -60
fi
if [[ $what == lm-head-rows ]]; then
  # The lm_head at decode batches of 2-16 on the GEMV (shared.models.llama.LM_HEAD_ROWS_GEMV) against cuBLAS: alone with
  # a tile sweep, then decode steps at batch 1-16 alternated twice. ~3 min.
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k "bf16_rows" 2>&1 | tail -2
  timeout 300 python3 -m bench.probe lm_head_rows 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/lm_head_rows.log" | tail -16
fi
if [[ $what == bf16-rows ]]; then
  # bf16 weights at decode batches of 2-16 on the several-row GEMV (kernels.ops.GEMV_MAX_M = 16 and the lm_head,
  # shared.models.llama.LM_HEAD_ROWS_GEMV, since 2026-12-06) against cuBLAS past one row (the former default): the
  # tiles swept per linear at 8 rows (bench.probe bf16_small_m), then decode steps at batch 1..32 in the engine at the
  # table's tiles (kernels.gemv.BF16_ROWS_TILES, swept on an H100) and at this card's sweep, alternated twice. ~5 min.
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and gemv_rows" 2>&1 | tail -2
  timeout 450 python3 -c "
import json, os
import bench.probe as P
res = {}
P.probe_bf16_small_m(res)
json.dump(res, open(os.environ['OUT'] + '/probe_bf16_rows.json', 'w'), indent=1)
cublas = (None, {'kernels.ops.GEMV_MAX_M': 1, 'shared.models.llama.LM_HEAD_ROWS_GEMV': False})
swept = P.swept_variants(res)
P.probe_fp8_batches(res, variants={'bf16': (None, {}), 'bf16_cublas': cublas, **swept, 'bf16_again': (None, {}),
                                   'bf16_cublas_again': cublas, **{k + '_again': v for k, v in swept.items()}},
                    batches=(1, 2, 4, 8, 16, 32), swept=False)
json.dump(res, open(os.environ['OUT'] + '/probe_bf16_rows.json', 'w'), indent=1)
" 2>&1 | grep -v "Capturing\|Warning\|warn" | tee "$OUT/bf16_rows.log" | tail -40
fi
if [[ $what == fp8-rows-pdl ]]; then
  # The several-row FP8 GEMV in the engine at its swept tiles, PDL on and off (fp8-rows, 12-06: 2x slower in the engine
  # than its kernels alone predicted).
  timeout 400 python3 -m bench.probe fp8_batches_pdl 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/fp8_rows_pdl.log" | tail -30
fi
if [[ $what == l2-prefetch ]]; then
  # Issue 14's two batch-1 ideas not measured when they landed (2026-12-04): --decode-l2-prefetch and the split
  # norm producers' late trigger (kernels.gemv.PRODUCER_LATE_TRIGGER). Their GPU tests, one A/B, the kernel trace.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "l2_prefetch or late_trigger" 2>&1 | tail -3
  timeout 300 python3 -m bench.b1 --variants "base=;prefetch=decode_l2_prefetch=1;late=@kernels.gemv.PRODUCER_LATE_TRIGGER=1" \
    --rounds 2 --quantization none,fp8 2>&1 | grep "round" | tee "$OUT/b1_next14.log"
  timeout 120 python3 -m bench.probe trace_pdl_prefetch 2>&1 | grep -v "Capturing\|Warning" | tail -16
fi
if [[ $what == batch1-next || $what == batch1-all ]]; then
  # Issue 14, batch 1, ideas of 2026-12-04 never run on a GPU: rope and the KV store in the qkv GEMV's epilogue
  # (--decode-rope-fusion), decode attention's first k/v tile before its PDL wait ($KV), the final norm split into
  # the lm_head GEMV ($FOLD). Their GPU tests, then one bf16 A/B (2 rounds): each alone and all three.
  # batch1-all adds l2-prefetch's two ideas to both (one machine start; ~8 min on a fresh machine by estimate).
  tests="gemv_rope_store or rope_fusion or rope_in_the_qkv or kv_before_wait or final_norm or embed_rms_norm or decode_norm_fusion"
  tests="$tests or bf16_graph or mixed_chunk or decode_tail"
  variants="base=;rope=decode_rope_fusion=1;kv=$KV;fold=$FOLD;all=decode_rope_fusion=1,$KV,$FOLD"
  if [[ $what == batch1-all ]]; then
    tests="$tests or l2_prefetch or late_trigger"
    variants="$variants;prefetch=decode_l2_prefetch=1;late=@kernels.gemv.PRODUCER_LATE_TRIGGER=1"
  fi
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py tests/test_model_parity.py \
    -k "not interpreted and ($tests)" 2>&1 | tail -3
  timeout 380 python3 -m bench.b1 --variants "$variants" --rounds 2 2>&1 | grep "round" | tee "$OUT/b1_$what.log"
fi
if [[ $what == batch1-next-trace ]]; then
  # The kernel traces (after batch1-next), and the rope epilogue's inputs in the program's tail.
  timeout 200 python3 -m bench.b1 --variants "rope=decode_rope_fusion=1;tail=decode_rope_fusion=1,@kernels.gemv.ROPE_INPUTS_AHEAD=0" \
    --rounds 2 2>&1 | grep "round" | tee "$OUT/b1_rope_tail.log"
  timeout 150 python3 -m bench.probe trace_pdl trace_pdl_rope trace_pdl_kv 2>&1 | grep -v "Capturing\|Warning" | tail -40
fi
if [[ $what == fp8-down ]]; then
  # FP8 down_proj, the laggard of the H100's 12-05 trace (2.59 TB/s, bf16's 2.99 on the shape): its tiles swept in the
  # 32-layer chain (~4 min), then the pick, if any, A/B'd in the batch-1 step against the default and bf16 (~2 min).
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda_bf16 and gemv_fp8_down_tiles" \
    2>&1 | tail -2
  timeout 320 python3 -m bench.gemv_chain_sweep --fp8-down-study --budget 240 --out "$OUT" 2>&1 \
    | grep -v "^  .*: [A-Za-z]*Error" | tee "$OUT/fp8_down_study.log" | tail -5
  P=$(cat "$OUT/fp8_down_pick.txt" 2>/dev/null)
  if [[ -n $P ]]; then
    timeout 150 python3 -m bench.b1 --variants "bf16=quantization=none;default=;pick=@kernels.gemv.FP8_DOWN_TILE=$P" \
      --rounds 4 --quantization fp8 2>&1 | grep "round" | grep -v '^{' | tee "$OUT/b1_fp8_down.log"
  fi
fi
if [[ $what == ideas ]]; then
  # gate-up and long-extend in one call (~4 min on a fresh H100 with ROUNDS=2, 2026-12-06): both ideas' GPU tests, then
  # one alternated batch-1 A/B, bf16 and FP8, three rounds (ROUNDS=2 when device time is short): each knob alone and
  # both. Since 2026-12-06 both are defaults (GATE_UP_EPILOGUE for bf16 weights only): "base" now has them; A/B with
  # =0 (LONG_MAX_TOKENS=0, GATE_UP_EPILOGUE=0) or GATE_UP_EPILOGUE_FP8=1.
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_model_parity.py tests/test_engine.py \
    -k "(cuda_bf16 and gemv_gated_out) or gate_up_epilogue_on_cuda or extends_in_cuda_graphs" 2>&1 | tail -3
  G=@shared.models.llama.GATE_UP_EPILOGUE=1; L=@shared.engine.extend_graph.LONG_MAX_TOKENS=512
  timeout 270 python3 -m bench.b1 --variants "base=;gated=$G;long=$L;both=$G,$L" --rounds "${ROUNDS:-3}" --quantization none,fp8 \
    2>&1 | grep "round" | grep -v '^{' | tee "$OUT/b1_ideas.log"
fi
if [[ $what == gate-up ]]; then
  # The MLP gated in gate_up_proj's epilogue (shared.models.llama.GATE_UP_EPILOGUE, on for bf16 weights since
  # 2026-12-06; GATE_UP_EPILOGUE_FP8, off): down_proj then reads I values, not 2I with silu * up in its load. The GPU
  # checks, then three rounds of the batch-1 step, bf16 and FP8: the defaults, the epilogue off, on for FP8 too.
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_model_parity.py \
    -k "(cuda_bf16 and gemv_gated_out) or gate_up_epilogue_on_cuda" 2>&1 | tail -3
  G=@shared.models.llama.GATE_UP_EPILOGUE; G8=@shared.models.llama.GATE_UP_EPILOGUE_FP8
  timeout 240 python3 -m bench.b1 --variants "base=;off=$G=0;fp8_on=$G8=1" --rounds "${ROUNDS:-3}" --quantization none,fp8 2>&1 | grep "round" \
    | grep -v '^{' | tee "$OUT/b1_gate_up.log"
fi
if [[ $what == long-extend ]]; then
  # Long-extend CUDA graphs (shared.engine.extend_graph.LONG_MAX_TOKENS, 512 since 2026-12-06): a prompt of 65-512
  # new tokens in few requests replays a graph instead of ~300 launches from Python. The GPU tests, then three rounds
  # of the batch-1 run (a 512-token prompt) with and without, bf16 and FP8: its "prefill ~" figure.
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k "extends_in_cuda_graphs" 2>&1 | tail -3
  L=@shared.engine.extend_graph.LONG_MAX_TOKENS=0
  timeout 300 python3 -m bench.b1 --variants "base=;eager=$L" --rounds "${ROUNDS:-3}" --quantization none,fp8 2>&1 | grep "round" \
    | grep -v '^{' | tee "$OUT/b1_long_extend.log"
fi
if [[ $what == tput-layout ]]; then
  # Issue 14's throughput: decode attention at batch 256 reads 0.84 of copy alone and 0.77 inside the step (H200,
  # 12-05). Alone, by the pool's slot order (each request's tokens in one run, as benchmarked; page size 1's decode
  # tokens a step apart, as the workload runs; pages of 16; random), then the workload at page size 1 and 16 (~5 min).
  timeout 480 python3 -m bench.probe decode256_layout tput_page 2>&1 | grep "decode256_layout\|tput_page\|Error" \
    | tee "$OUT/tput_layout.log"
fi
if [[ $what == fp8-rope ]]; then
  # FP8 qkv weights with rope + the KV store in the GEMV's epilogue (shared.models.llama.FP8_ROPE_EPILOGUE, off): the
  # GPU checks, then five rounds against the default and bf16 (~2 min).
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_model_parity.py \
    -k "(cuda_bf16 and gemv_rope_store) or rope_in_the_qkv_epilogue_on_cuda or fp8_rows_in_the_row_kernel" 2>&1 | tail -3
  R=@shared.models.llama.FP8_ROPE_EPILOGUE=1
  timeout 200 python3 -m bench.b1 --variants "bf16=quantization=none;default=;rope=$R" --rounds 5 --quantization fp8 \
    2>&1 | grep "round" | grep -v '^{' | tee "$OUT/b1_fp8_rope.log"
fi
if [[ $what == fp8-h200 ]]; then
  # The FP8 defaults adopted on an H100 (2026-12-05), A/B'd on this card in one call: the bf16 step, the FP8 default,
  # the former long-K tiles (FP8_LONG_TILES=0), the reduce kernel (SPLITK_TICKETS=0), neither, and the rope epilogue
  # (FP8_ROPE_EPILOGUE=1; fp8-rope's A/B, +2.2% on the H200 at older tiles), three rounds (~3 min).
  L=@kernels.gemv.FP8_LONG_TILES=0; T=@kernels.gemv.SPLITK_TICKETS=0; R=@shared.models.llama.FP8_ROPE_EPILOGUE=1
  timeout 300 python3 -m bench.b1 --variants "bf16=quantization=none;default=;former_tiles=$L;reduce=$T;neither=$L,$T;rope=$R" \
    --rounds 3 --quantization fp8 2>&1 | grep "round" | grep -v '^{' | tee "$OUT/b1_fp8_h200_ab.log"
  # Only if the former tiles' median step beats the default's: the chain sweep on this card (~5 min).
  if python3 -c "import re,statistics as s,sys
t={}
for m in re.finditer(r'(\S+) \S+ round \d+: step ([0-9.]+) ms', open('$OUT/b1_fp8_h200_ab.log').read()):
    t.setdefault(m[1], []).append(float(m[2]))
sys.exit(0 if t.get('former_tiles') and s.median(t['former_tiles']) < s.median(t['default']) else 1)"; then
    timeout 290 python3 -m bench.gemv_chain_sweep --dtypes fp8 --budget 200 --out "$OUT" 2>&1 \
      | grep -v "^  .*: [A-Za-z]*Error" | tee "$OUT/chain_fp8.log" | tail -6
  fi
fi
if [[ $what == kv-fp8 ]]; then
  # --kv-cache-dtype fp8_e4m3 (2026-12-05, built without a GPU), first call: the FP8-pool kernel checks and the
  # FP8-KV engine tests on the GPU, then decode attention alone over bf16 and FP8 pools (tiles, 64-row query tiles,
  # no head-dim mask: bench.probe kvfp8_kernel).
  # 200 s stopped a fresh H100 compiling the kernel checks after the 11 engine tests (2026-12-05).
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kv_cache_fp8.py \
    -k "not interpreted and not pd and (fp8 or backend_end_to_end)" 2>&1 | tee "$OUT/kv_fp8_tests.log" | tail -4
  timeout 300 python3 -m bench.probe kvfp8_kernel 2>&1 | tee "$OUT/probe_kvfp8_kernel.log" | tail -40
fi
if [[ $what == kv-fp8-tput ]]; then
  # Second call: the throughput workload with each pool (bench.probe kvfp8_tput), the batch-256 graph traced with each,
  # then the batch-1 step (512-token context) with each.
  timeout 400 python3 -m bench.probe kvfp8_tput 2>&1 | grep -v Capturing | tee "$OUT/probe_kvfp8_tput.log" | tail -12
  timeout 200 python3 -m bench.probe trace256 trace256_kvfp8 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/trace256_kvfp8.log" \
    | grep "charged\|span"
  timeout 150 python3 -m bench.b1 --variants "bf16kv=;fp8kv=kv_cache_dtype=fp8_e4m3" --rounds 2 2>&1 | grep "round" \
    | tee "$OUT/b1_kvfp8.log"
fi
if [[ $what == fp8-block ]]; then
  # Block-scaled FP8 weights (2026-12-05, built without a GPU), first call: the block GEMV and GEMM kernel checks and
  # the model and ops tests on the GPU, then the block linears alone against bf16 and per-channel FP8 at Llama-8B's
  # shapes, the GEMM's tiles and K splits swept (bench.fp8_block_gemm --sweep).
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_quantization.py \
    -k "not interpreted and (block or fp8_kernels)" 2>&1 | tee "$OUT/fp8_block_tests.log" | tail -4
  timeout 420 python3 -m bench.fp8_block_gemm --sweep --out "$OUT" 2>&1 | tee "$OUT/fp8_block_gemm.log" | tail -45
fi
if [[ $what == fp8-block-e2e ]]; then
  # Second call: bench.fp8 with the block variant ([128, 128], Llama-3.1-8B shape, dummy weights drawn per block):
  # batch-1 step, graph replay and a 64-request throughput run against bf16 and per-channel FP8.
  timeout 540 python3 -m bench.fp8 --block --reqs 64 --out "$OUT" 2>&1 | grep -v Capturing | tee "$OUT/fp8_block.log" \
    | tail -8
fi
if [[ $what == fp8-row ]]; then
  # Issue 14 item 3: FP8 weights in the one-row GEMV (kernels.gemv.FP8_ROW_KERNEL, 2026-12-04, never run on a GPU): its
  # GPU tests, the 32-layer chain against the general kernel and its tiles swept, then a batch-1 FP8 A/B, alone and
  # with batch1-next's three ideas.
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_model_parity.py \
    -k "not interpreted and (gemv_fp8 or fp8_rows_in_the_row_kernel)" 2>&1 | tail -3
  timeout 230 python3 -m bench.gemv_chain_sweep --fp8-row-study --budget 170 2>&1 | tee "$OUT/fp8_row_study.log" | tail -12
  timeout 150 python3 -m bench.b1 --variants "general=;row=@kernels.gemv.FP8_ROW_KERNEL=1;all=@kernels.gemv.FP8_ROW_KERNEL=1,decode_rope_fusion=1,$KV,$FOLD" \
    --rounds 2 --quantization fp8 2>&1 | grep "round" | tee "$OUT/b1_fp8_row.log"
fi
if [[ $what == probes ]]; then
  # Where issue 14's batch-1, batch-256 and prefill time goes (bench/probe.py; 2026-12-01: ~3 min).
  timeout 450 python3 -m bench.probe b1phases steps trace_pdl trace256 trace_prefill eager_host trace_extend extend_pack prefill_attn 2>&1 \
    | grep -v "Capturing\|Warning" | tee "$OUT/probes.log" | tail -60
fi
if [[ $what == b1-attn ]]; then
  # Decode attention's merge in one launch against two (kernels, then engines alternated), batch 1; with the
  # GPU tests of both merges first (over 200 s of compiles on 2026-12-04: the summary was cut).
  timeout 330 python3 -m pytest -q -p no:cacheprovider \
    -k "not interpreted and (test_cuda or one_launch or pdl_launches or decode_in_cuda_graphs)" tests/test_kernels.py \
    tests/test_engine.py 2>&1 | tee "$OUT/b1_attn_tests.log" | tail -8
  timeout 280 python3 -m bench.b1_attn 2>&1 | grep -v "Capturing\|Warning" | tee "$OUT/b1_attn.log" | tail -45
fi
if [[ $what == sync-audit ]]; then
  timeout 240 python3 -m bench.sync_audit 2>&1 | tee "$OUT/sync_audit.log" | tail -40
fi
if [[ $what == pd-decode-heavy ]]; then
  timeout 330 python3 -m bench.pd --out "$OUT" --duration 30 --rate 8 --min-prompt 256 --max-prompt 768 \
    --output-len 256 2>&1 | tee "$OUT/pd_decode_heavy.log" | tail -12
fi
if [[ $what == workloads ]]; then
  # The paper's workloads and ablations (bench/workloads): 4 stacks of the 8B shape, random weights.
  timeout 580 python3 -m bench.workloads --ablations --out "$OUT" --parallel 16 --instances 48 --duration 5 --budget 540 \
    2>&1 | tee "$OUT/workloads.log" | tail -60
fi
