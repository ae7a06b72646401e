"""Every bench/ module imports on a CPU machine and every suite benchmark answers --help: a helper renamed in
one module must not leave another broken until someone runs it on the GPU (a benchmark once imported a name
bench/pd.py no longer had)."""
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# What a user runs: `python -m bench.X`, each documented in docs/performance.md.
SUITE = ("ab", "attention", "backends", "fp8", "hicache", "kernels", "kv_routing", "multiturn", "offline", "pd",
         "reference_models", "serving", "shared_prefix", "spec", "structured", "tp", "workloads")


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")


@pytest.mark.parametrize("name", SUITE)
def test_suite_benchmark_answers_help(name, monkeypatch, capsys):
    """`python -m bench.X --help` exits 0 with the module's usage (run in this process: the modules are imported
    above, a child per module would import torch ten times)."""
    mod = importlib.import_module(f"bench.{name}.__main__" if name == "workloads" else f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0
    assert f"python -m bench.{name}" in capsys.readouterr().out


def test_gpu_run_kinds_run_suite_benchmarks_only():
    """bench/gpu_run.sh: its usage lists at most 12 kinds, each one a case of the script; every benchmark it runs
    is in the suite, and docs/performance.md names every suite benchmark."""
    r = subprocess.run(["bash", str(BENCH / "gpu_run.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    kinds = re.findall(r"^  ([a-z0-9-]+)  ", r.stdout, flags=re.M)
    script = (BENCH / "gpu_run.sh").read_text()
    assert 8 <= len(kinds) <= 12 and all(re.search(rf"^  {k}\)", script, flags=re.M) for k in kinds), kinds
    accepted = re.search(r"^  (tests\|[a-z0-9|-]+)\) shift ;;", script, flags=re.M)[1].split("|")
    assert sorted(accepted) == sorted(kinds)
    assert set(re.findall(r"python3 -m bench\.(\w+)", script)) <= set(SUITE)
    docs = (ROOT / "docs" / "performance.md").read_text()
    assert all(f"bench.{name}" in docs for name in SUITE)


def test_ab_alternates_variants_in_child_processes_with_their_environment(tmp_path, capsys):
    """bench.ab: each round runs every variant once, in order, in a child with its variables and OUT set; verdict
    lines are relayed with the variant and round, every line is kept in the run's log, a failing run is counted."""
    from bench.ab import main, parse_variant
    cmd = [sys.executable, "-c", "import os; print('noise'); print('PASS', os.environ.get('RADIXSERVE_K'), "
           "os.environ['OUT'].rsplit('/', 1)[1]); raise SystemExit(os.environ.get('RADIXSERVE_K') == 'bad')"]
    assert main(["--rounds", "2", "--out", str(tmp_path), "base", "k:RADIXSERVE_K=0", "--", *cmd]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["[base 1] PASS None base-1", "[k 1] PASS 0 k-1", "[base 2] PASS None base-2", "[k 2] PASS 0 k-2"]
    assert (tmp_path / "k-2.log").read_text() == "noise\nPASS 0 k-2\n"
    assert main(["--rounds", "1", "--out", str(tmp_path), "a:RADIXSERVE_K=bad", "--", *cmd]) == 1
    assert parse_variant("x:A=1,B_2=") == ("x", {"A": "1", "B_2": ""})
    for bad in ("x:a=1", "x:A", "", "x y"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_offline_roofline_counts_decode_gemm_flops_only_when_asked():
    """bench.offline's throughput roofline: without a decode rate each decode step is a weight + KV stream (the
    burst info line's model); with one (the goal's since 2026-12-06), a batch-256 step on the 8B shape is priced at
    its GEMMs' FLOPs (compute-bound), a batch-1 step still at the stream."""
    from bench.common import SHAPES
    from bench.offline import throughput_roofline
    cfg = SHAPES["llama-3.1-8b"]
    tok_s, t_pf, t_dec = throughput_roofline(cfg, 256, 512, 128, 4.2e12, 780)
    assert 8500 < tok_s < 9500 and t_pf > 1 and 0.9 < t_dec < 1.2
    c_tok_s, c_pf, c_dec = throughput_roofline(cfg, 256, 512, 128, 4.2e12, 780, decode_tflops=780)
    assert c_pf == t_pf and c_dec > t_dec + 0.1 and c_tok_s < tok_s
    assert throughput_roofline(cfg, 1, 512, 128, 4.2e12, 780, decode_tflops=780) == \
        throughput_roofline(cfg, 1, 512, 128, 4.2e12, 780)


def test_sse_events_yields_the_data_lines_json_and_stops_at_done():
    """bench.common.sse_events (bench.serving and bench.pd read streams through it): `data:` lines parsed, blank lines,
    comments and the [DONE] sentinel left out."""
    import asyncio
    import types

    from bench.common import sse_events

    async def content():
        for line in (b'data: {"a": 1}\n', b"\n", b": keep-alive\n", b'data: {"error": "x"}\r\n', b"data: [DONE]\n"):
            yield line

    async def collect():
        return [ev async for ev in sse_events(types.SimpleNamespace(content=content()))]
    assert asyncio.run(collect()) == [{"a": 1}, {"error": "x"}]


def test_fp8_bench_reports_the_decode_step_without_the_prefill(tmp_path, monkeypatch, capsys):
    """bench.fp8 on the tiny shape (CPU): the goal's line from the medians of alternated rounds (the throughput run in
    the first only), and beside it each engine's decode step alone (the median period between decode launches, the
    prompt's prefill not spread over it) and their ratio."""
    import functools
    import json
    import sys

    import bench.common
    import bench.fp8
    monkeypatch.setattr(bench.fp8, "model_dir", functools.partial(bench.common.model_dir, root=str(tmp_path / "m")))
    monkeypatch.setattr(sys, "argv", ["fp8", "--shape", "tiny", "--reqs", "2", "--steps", "6", "--rounds", "2", "--out",
                                      str(tmp_path / "out")])
    bench.fp8.main()
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "fp8.json").read_text())
    a, b = res["none"]["b1_period_ms"], res["fp8"]["b1_period_ms"]
    assert 0 < a and 0 < b
    assert [("tput_tok_s" in f) for f in res["fp8"]["rounds"]] == [True, False]
    steps = sorted(f["b1_step_ms"] for f in res["none"]["rounds"])
    assert res["none"]["b1_step_ms"] == steps[1]  # bench.common.median: the upper of two
    assert "fp8 batch-1 step" in out and "medians of 2 alternated rounds" in out
    assert f"fp8 {b:.3f} ms, bf16 {a:.3f} ms, {b / a:.3f} x" in out
    pa, pb = res["none"]["b1_prefill_ms"], res["fp8"]["b1_prefill_ms"]
    assert f"prefill, beyond the decode steps: fp8 ~{pb:.1f} ms, bf16 ~{pa:.1f} ms" in out
