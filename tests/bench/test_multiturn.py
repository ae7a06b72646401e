"""bench/multiturn.py: the workload's arithmetic (what the goals are judged against) and a CPU smoke run of the whole
benchmark on the tiny shape through real stacks (the figures mean something only on the GPU)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.multiturn import Workload, host_ratio_for, tier_figures, tier_supported, verdicts


def test_workload_lengths_working_set_and_ideal():
    w = Workload(conversations=4, turns=3, user_len=10, answer_len=5)
    assert [w.prompt_len(t) for t in range(3)] == [10, 25, 40]
    assert w.working_set() == 4 * 45
    # Turn 1 finds turn 0's prompt and its answer but the last token (14 of 25); turn 2: 29 of 40.
    assert w.ideal_hit_rate() == pytest.approx((14 + 29) / (10 + 25 + 40))
    users = w.user_messages()
    assert len(users) == 4 and all(len(u) == 3 and all(len(m) == 10 for m in u) for u in users)
    assert users == w.user_messages() and users[0] != users[1]  # fixed seed, distinct conversations
    assert host_ratio_for(Workload(32, 8, 384, 128), 30000) * 30000 >= Workload(32, 8, 384, 128).working_set()


def test_tier_figures_and_verdicts():
    figs = tier_figures({"bytes_h2d": 100, "load_seconds_sum": 1.0, "hit_tokens": 5},
                        {"bytes_h2d": 1100, "load_seconds_sum": 3.0, "hit_tokens": 9, "nodes": 3})
    assert figs == {"bytes_h2d": 1000, "load_seconds_sum": 2.0, "hit_tokens": 4, "load_bw_Bps": 500.0}
    run = {"turns": 10, "errors": 0, "error_examples": [], "ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0,
           "out_tok_s": 1000.0, "hit_rate": 0.2, "tier": {}}
    on = {**run, "ttft_p50_ms": 40.0, "out_tok_s": 1400.0, "hit_rate": 0.5, "tier": figs}
    res = {"working_set_tokens": 1000, "working_set_of_pool": 5.0, "ideal_hit_rate": 0.5, "pinned_h2d_Bps": 600.0,
           "runs": {"off": run, "on": on}}
    assert [v for v, _ in verdicts(res, judged=True)] == ["PASS"] * 5 + ["INFO"], verdicts(res, True)
    assert all(v == "INFO" for v, _ in verdicts(res, judged=False))  # the CPU's figures are not judged
    slow = {**res, "runs": {"off": run, "on": {**on, "out_tok_s": 1100.0}}}
    assert [v for v, t in verdicts(slow, True) if t.startswith("output throughput")] == ["FAIL"]
    no_tier = {**res, "runs": {"off": run}, "on_skipped": "no flag"}
    assert verdicts(no_tier, True)[-1] == ("SKIP", "host tier: no flag")


@pytest.mark.e2e
def test_smoke_run_on_the_cpu(tmp_path):
    """python -m bench.multiturn on the tiny shape, one stack (a stack start is most of the time; the on/off verdicts
    are tested above): the tier-on run where this build has the host tier, else the tier-off run, completes every
    turn, the table and verdict lines print, the JSON is written. With the tier, every reusable token is reused."""
    from tests.support.stack import ROOT, free_port

    run = "on" if tier_supported() else "off"
    r = subprocess.run([sys.executable, "-m", "bench.multiturn", "--shape", "tiny", "--conversations", "3",
                        "--turns", "3", "--user-len", "16", "--answer-len", "4", "--max-total-tokens", "96",
                        "--rate", "inf", "--runs", run, "--port", str(free_port()), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "multiturn.json").read_text())
    s = res["runs"][run]
    assert list(res["runs"]) == [run] and s["turns"] == 9 and s["errors"] == 0 and s["ttft_p50_ms"] > 0, s
    # Later turns carry their conversation's history: some of it (with the host tier, all of it) came from the cache.
    assert 0 < s["hit_rate"] <= res["ideal_hit_rate"] + 1e-9, s
    if run == "on":
        assert s["hit_rate"] >= 0.9 * res["ideal_hit_rate"] and s["tier"].get("host_hit_tokens", 0) > 0, s
    assert "working set 180 tokens" in r.stdout and f"\n{run} " in r.stdout and "SKIP  " in r.stdout, r.stdout
