"""Where the engine thread makes the CPU wait for the GPU, found by torch itself.

Overlap scheduling only pays if building step N+1 never waits for step N. torch's CUDA sync debug mode
warns at every synchronizing call (a D2H copy, `.item()`, `.tolist()` of a device tensor, a pageable H2D
copy, `nonzero`...). This runs a mixed workload through the engine with that mode on and prints each
call site in our code (file:line of the innermost frame under shared/, kernels/ or services/) with its
count, so a new sync on the hot path is one line in the output.

    python -m bench.sync_audit [--shape llama-3.1-8b] [--prompts 64] [--allow FILE:LINE ...]

The expected waits (the step result's event in the engine loop) are CUDA event syncs, which the
debug mode does not report. `--check` exits 1 when a site outside `--allow` syncs more than once per step.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import SHAPES, drive, log, model_dir, random_prompts  # noqa: E402

_OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("shared", "kernels", "services"))


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in our code, with the chain of our callers above it (up to three)."""
    ours = [f for f in stack if f.filename.startswith(_OURS)]
    if not ours:
        return "(outside our code)"
    chain = [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in ours[-3:]]
    return " <- ".join(reversed(chain))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--allow", nargs="*", default=[], help="file:line sites allowed to sync")
    args = ap.parse_args()

    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.tokenizer import Tokenizer

    if not torch.cuda.is_available():
        raise SystemExit("sync_audit needs a GPU")
    path = model_dir(args.shape)
    eng = Engine(EngineConfig(model_path=path, load_format="dummy", max_context_len=8192, cuda_graph=True),
                 Tokenizer.load(path), on_output=lambda o: None)
    n = args.prompts
    shared_prefix = random_prompts(1, 1024, 400, seed=1)[0]
    workloads = {
        "plain 512 in / 64 out": (random_prompts(n, 512, 400, seed=2), {"max_new_tokens": 64}),
        "shared 1k prefix + 64": ([shared_prefix + p for p in random_prompts(n, 64, 400, seed=3)],
                                  {"max_new_tokens": 32}),
        "sampled (top_p, penalties)": (random_prompts(n // 2, 256, 400, seed=4),
                                       {"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.9,
                                        "frequency_penalty": 0.5}),
    }
    drive(eng, random_prompts(4, 64, 400, seed=9), {"max_new_tokens": 4, "ignore_eos": True})  # warm-up
    failed = False
    for name, (prompts, sampling) in workloads.items():
        sites: collections.Counter = collections.Counter()
        steps0 = eng.steps

        def hook(message, category, filename, lineno, file=None, line=None):
            sites[_site(traceback.extract_stack()[:-1])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            old = warnings.showwarning
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                drive(eng, prompts, {"ignore_eos": True, **sampling})
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = old
        steps = max(1, eng.steps - steps0)
        log(f"{name}: {steps} steps, {sum(sites.values())} synchronizing calls")
        for site, count in sites.most_common(15):
            allowed = any(a in site for a in args.allow)
            per_step = count / steps
            flag = "" if allowed or per_step <= 1.0 else "  <-- more than once per step"
            failed |= bool(flag) and not allowed
            print(f"  {count:6d} ({per_step:5.2f}/step)  {site}{flag}")
    print("PASS: no unexpected synchronization" if not failed else "FAIL: sites above sync more than once per step")
    if args.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
