"""How the kernel checks run: every check_<name>(device, dtype) of tests/kernels/test_*.py against its torch
reference, on CUDA in process in bf16 (wider tolerances), and on the CPU under TRITON_INTERPRET=1 in fp32.

The interpreter flag must be set before the kernel modules are imported, which another test module may already have
done in this process: the interpreted checks run in worker processes (`python -m tests.kernels._runner NAME...`,
one JSON line of results each). All the test files' checks share two workers a session (CI has two cores), split
by cost (interpreted_groups), started by the first interpreted test that runs.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Seconds each check took alone, interpreted, on a 2-core AMD EPYC box (569 s in all when measured); a check not
# listed counts DEFAULT_COST. Split by hand before, one process ran 427 s alone and 483 s in .ci/run, near the
# limit below.
INTERPRETED_COST = {
    "extend_attention": 58.9, "gemv_rope_store": 53.9, "gemv_two_row_norms": 44.5, "gemv_gated_out": 43.8,
    "gemv_two_row_epilogues": 40.4, "gemv_fp8_blocks": 37.9, "gemv_two_rows": 31.5, "gemv_split_norm": 29.5,
    "gemv": 28.8, "gemv_fp8_codes": 26.8, "decode_attention": 22.7, "attention_fp8_pool": 20.2,
    "cascade_decode_attention": 17.7, "gemv_fp8_f16_math": 17.7, "gemv_silu_mul": 13.4,
    "decode_attention_one_launch": 10.6, "decode_attention_tiles": 7.5,
    "decode_attention_kv_before_wait": 8.6, "backend_end_to_end": 7.9, "gemv_splitk_tickets": 5.8,
    "gemv_row_kernel": 5.7, "gemv_rope_store_rows": 4.7, "extend_attention_tma": 8.0, "fp8_block_gemm": 4.0,
    "gemv_fp8_rows": 3.8, "backend_cascade_decode": 2.7, "store_kv_fp8": 2.6,
    "backend_extend_decode_tail": 2.2, "decode_attention_single_stage": 1.9, "gemv_rows": 0.6, "rope_store_kv": 0.6,
    "per_token_quant": 0.3, "rope": 0.2, "store_kv": 0.2, "rms_norm": 0.1, "backend_fallback": 0.0,
    "decode_inputs": 0.0, "embed_rms_norm": 0.0, "silu_and_mul": 0.0, "paged_kv_indices": 1.0}
DEFAULT_COST = 10.0
INTERPRETED_TIMEOUT = 600  # seconds for both workers; test_interpreted_cpu's own limit is above it


def checks_of(module_globals: dict) -> dict:
    """{name: check_<name>} of one test module."""
    return {n[len("check_"):]: fn for n, fn in sorted(module_globals.items()) if n.startswith("check_")}


def all_checks() -> dict:
    """Every test file's checks, by name (names are unique across the files)."""
    checks: dict = {}
    for path in sorted(HERE.glob("test_*.py")):
        found = checks_of(vars(importlib.import_module(f"tests.kernels.{path.stem}")))
        assert not set(found) & set(checks), f"{path.name} repeats a check name: {sorted(set(found) & set(checks))}"
        checks.update(found)
    return checks


def interpreted_groups(names, n: int = 2) -> list[list[str]]:
    """names split into n groups of about equal cost (the costliest first, each to the group with the least)."""
    groups: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for name in sorted(names, key=lambda k: (-INTERPRETED_COST.get(k, DEFAULT_COST), k)):
        i = loads.index(min(loads))
        groups[i].append(name)
        loads[i] += INTERPRETED_COST.get(name, DEFAULT_COST)
    return [g for g in groups if g]


def run_interpreted(names) -> dict[str, str]:
    """{name: "ok" or its traceback} for the checks `names`, run interpreted in worker processes at once."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.kernels._runner", *group], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for group in interpreted_groups(names)]
    results = {}
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=INTERPRETED_TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")]
        assert lines, f"kernel worker crashed (rc={proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}"
        results.update(json.loads(lines[-1][len("RESULTS "):]))
    return results


def kernel_tests(module_globals: dict):
    """A test module's two tests of its checks: interpreted on the CPU (the session's workers' results) and on
    CUDA in bf16. `test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())` at the module's end."""
    checks = checks_of(module_globals)

    @pytest.mark.timeout(INTERPRETED_TIMEOUT + 60)  # the first one waits for the session's workers
    @pytest.mark.parametrize("name", list(checks))
    def test_interpreted_cpu(name, interpreted_results):
        assert interpreted_results[name] == "ok", interpreted_results[name]

    @pytest.mark.gpu
    @pytest.mark.parametrize("name", list(checks))
    def test_cuda_bf16(name):
        torch.manual_seed(0)
        checks[name](torch.device("cuda"), torch.bfloat16)

    return test_interpreted_cpu, test_cuda_bf16


def _worker(names) -> None:
    """In a TRITON_INTERPRET=1 worker: fp32 on the CPU, every failure reported, one JSON line of results."""
    checks = all_checks()
    torch.manual_seed(0)
    results = {}
    for name in names:
        try:
            checks[name](torch.device("cpu"), torch.float32)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    _worker(sys.argv[1:] or list(all_checks()))
