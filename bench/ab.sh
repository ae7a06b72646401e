#!/usr/bin/env bash
# A/B of a change in one device call: CMD runs on the working tree as it is ("new") and with PATCH
# reverse-applied ("old"), alternated ROUNDS times, so both sides share the call's clocks and drift
# (figures compared across calls moved by a few percent on their own, bench/RESULTS.md).
#   git diff <base> -- kernels shared services > ab.patch      # here; an untracked file travels along
#   bash bench/ab.sh ab.patch 2 python3 -m bench.b1 --quantization none,fp8   # on the device
# CMD sees AB_LABEL=new|old; its output is prefixed with the label. The tree is restored at the end.
set -uo pipefail
patch=$1 rounds=$2; shift 2
[[ -f $patch && $rounds -ge 1 && $# -ge 1 ]] || { echo "usage: bench/ab.sh PATCH ROUNDS CMD..." >&2; exit 2; }
git apply -R --check "$patch" || { echo "ab.sh: $patch does not reverse-apply to this tree" >&2; exit 2; }
source "$(dirname "$0")/device_env.sh" || exit 1
reverted=0
restore() { if (( reverted )); then git apply "$patch" && reverted=0; fi; }
trap restore EXIT
for ((r = 1; r <= rounds; r++)); do
  for side in new old; do
    if [[ $side == old ]]; then git apply -R "$patch" && reverted=1 || exit 1; fi
    AB_LABEL=$side "$@" 2>&1 | sed "s/^/[$side $r] /"
    restore
  done
done
