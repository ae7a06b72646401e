"""bench/backends.py: its verdicts, and a CPU smoke run of the whole benchmark on the tiny shape (two backends that
run on a CPU; on the GPU it is the default against FlashInfer's: the figures mean something only there)."""
from __future__ import annotations

import json
import subprocess
import sys

from bench.backends import GOALS, verdicts


def test_verdicts_allow_the_spread_and_judge_only_where_asked():
    ref = {"b1_step_ms": 10.0, "tput_tok_s": 1000.0, "prefill_tok_s": 5000.0, "cached_prefill_ttft_ms": 20.0}
    close = {"b1_step_ms": 9.95, "tput_tok_s": 1005.0, "prefill_tok_s": 5040.0, "cached_prefill_ttft_ms": 19.9}
    res = {"auto": ref, "flashinfer": close}
    got = verdicts(res, ["auto", "flashinfer"], judged=True)
    assert [v for v, _ in got] == ["PASS"] * 5, got  # within 1% either way: the default holds
    faster = {**close, "tput_tok_s": 1020.0, "b1_step_ms": 9.8}
    got = verdicts({"auto": ref, "flashinfer": faster}, ["auto", "flashinfer"], judged=True)
    assert [v for v, t in got if v == "FAIL"] == ["FAIL", "FAIL"]
    assert {t.split(":")[0] for v, t in got if v == "FAIL"} == {"batch-1 decode ms/step", "256x(512,128) out tok/s"}
    assert [v for v, _ in verdicts({"auto": ref, "flashinfer": faster}, ["auto", "flashinfer"], judged=False)][:4] \
        == ["INFO"] * len(GOALS)


def test_cpu_smoke_run(tmp_path):
    cmd = [sys.executable, "-m", "bench.backends", "--shape", "tiny", "--backends", "auto,torch", "--rounds", "2",
           "--reqs", "4", "--steps", "6", "--prefill-len", "1024", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads((tmp_path / "backends.json").read_text())
    for b in ("auto", "torch"):
        assert len(res[b]["rounds"]) == 2 and all(res[b][k] > 0 for k in GOALS), res[b]
        assert "tput_tok_s" not in res[b]["rounds"][0] and "tput_tok_s" in res[b]["rounds"][1]  # the second round's
        assert all("prefill_tok_s" in f and "cached_prefill_ttft_ms" in f for f in res[b]["rounds"])
    lines = run.stdout.splitlines()
    assert sum(line.startswith("INFO") for line in lines) == len(GOALS)  # the CPU's figures are not judged
    assert "PASS  the engine on torch ran every workload without an error" in lines


def test_refuses_a_single_backend_and_flashinfer_without_its_package():
    one = subprocess.run([sys.executable, "-m", "bench.backends", "--backends", "auto"], capture_output=True,
                         text=True, timeout=60)
    assert one.returncode == 2 and "two or more different backends" in one.stderr
    fi = subprocess.run([sys.executable, "-m", "bench.backends", "--backends", "auto,flashinfer"], capture_output=True,
                        text=True, timeout=60)
    import importlib.util
    if importlib.util.find_spec("flashinfer") is None:
        assert fi.returncode == 2 and "flashinfer-python" in fi.stderr


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """backends.json is written after each engine: a call stopped in a later round still has the earlier ones."""
    import pytest

    from bench import backends

    calls = []

    def figures(path, tok, cuda, vocab, reqs, steps, prefill=0, **config):
        calls.append((config["attention_backend"], reqs))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the device's time limit
        return {"b1_step_ms": 1.0 + len(calls), "prefill_tok_s": 10.0, "cached_prefill_ttft_ms": 5.0}

    monkeypatch.setattr(backends, "engine_figures", figures)
    monkeypatch.setattr("sys.argv", ["bench.backends", "--shape", "tiny", "--backends", "auto,torch",
                                     "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        backends.main()
    res = json.loads((tmp_path / "backends.json").read_text())
    assert calls[:2] == [("auto", 0), ("torch", 0)] and calls[2] == ("auto", 256)  # throughput: round 2
    assert res["auto"]["b1_step_ms"] == 2.0 and res["torch"]["b1_step_ms"] == 3.0
