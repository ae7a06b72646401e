"""A/B of runtime knobs: one benchmark command alternated between variants, each run a child process with its
variant's environment, so both sides share the machine's clocks and drift (figures compared across calls moved
by a few percent on their own).

    python -m bench.ab [--rounds 2] [--out DIR] VARIANT [VARIANT ...] -- CMD ...
    python -m bench.ab base notma:RADIXSERVE_TMA_MIN_TOKENS=1000000 -- python -m bench.offline --skip-hf

A VARIANT is NAME or NAME:VAR=VALUE,VAR=VALUE (environment variables, e.g. the runtime's RADIXSERVE_* knobs).
Round by round each variant runs CMD with OUT=DIR/NAME-ROUND (where the suite's benchmarks write by default);
its whole output goes to DIR/NAME-ROUND.log and its verdict and info lines (PASS, FAIL, info) are printed
here, prefixed with the variant and round. Exits 1 if a run exits non-zero.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

VERDICT = re.compile(r"^(PASS|FAIL|INFO|info)\b")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, assigns = spec.partition(":")
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"variant {spec!r}: a name of letters, digits, '_', '.', '-' first")
    env = {}
    for item in filter(None, assigns.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(var):
            raise ValueError(f"variant {spec!r}: {item!r} is not VAR=VALUE with an upper-case VAR")
        env[var] = value
    return name, env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", metavar="VARIANT")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not cmd:
        ap.error("no command after --")
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as e:
        ap.error(str(e))
    if len({n for n, _ in variants}) < len(variants):
        ap.error("variant names repeat")
    failed = 0
    for r in range(1, args.rounds + 1):
        for name, env in variants:
            out = os.path.join(args.out, f"{name}-{r}")
            os.makedirs(out, exist_ok=True)
            with open(out + ".log", "w") as log:
                p = subprocess.Popen(cmd, env={**os.environ, **env, "OUT": out}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                for line in p.stdout:
                    log.write(line)
                    if VERDICT.match(line):
                        print(f"[{name} {r}] {line}", end="", flush=True)
            if p.wait():
                failed += 1
                print(f"[{name} {r}] exit status {p.returncode} (log: {out}.log)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
