"""bench/shared_prefix.py in its CPU smoke mode: the workload runs through the real engine under every
configuration, the hit rate reaches the workload's ideal, and the goal lines are printed."""
from __future__ import annotations

from bench.shared_prefix import ideal_hit_rate, main, workload


def test_workload_and_ideal():
    ps = workload(3, 2, 10, 4, seed=0)
    assert len(ps) == 6 and all(len(p) == 14 for p in ps)
    assert ps[0][:10] == ps[3][:10] != ps[1][:10]  # interleaved: round k holds every group's k-th
    assert abs(ideal_hit_rate(64, 16, 2048, 128) - 15 * 2048 / (16 * 2176)) < 1e-12


def test_smoke_mode_runs_and_hits_the_ideal(tmp_path, capsys):
    res = main(["--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert set(res["runs"]) == {"lpm", "fcfs", "off"}
    assert res["runs"]["off"]["hit_rate"] == 0
    assert res["runs"]["lpm"]["hit_rate"] >= 0.95 * res["ideal_hit_rate"]
    assert "PASS  hit rate radix+LPM" in out and "decode step" in out
    assert res["shared_prefix_attention"] and res["decode_cascade_steps"]["shared_cascade"] > 0
    assert res["decode_cascade_steps"]["shared_plain"] == 0
    assert (tmp_path / "shared_prefix.json").exists()


def test_configs_at_a_concurrency_and_pipelined_step_times(tmp_path, capsys):
    res = main(["--smoke", "--out", str(tmp_path), "--configs", "lpm0,off@2,lpm0@2"])
    out = capsys.readouterr().out
    assert set(res["runs"]) == {"lpm0", "off@2", "lpm0@2"}
    assert "lpm0@2" in out and res["runs"]["lpm0@2"]["hit_rate"] >= 0.95 * res["ideal_hit_rate"]
    for name in ("shared_cascade", "shared_plain", "no_prefix"):
        assert res["decode_step_ms"][name] > 0 and res["decode_step_synced_ms"][name] > 0


def test_unknown_config_or_concurrency_is_a_clear_error():
    import pytest

    from bench.shared_prefix import config_overrides
    assert config_overrides("fcfs@8", 16) == {"schedule_policy": "fcfs", "max_running_requests": 8}
    with pytest.raises(SystemExit, match="unknown config"):
        config_overrides("lru", 16)
    with pytest.raises(SystemExit, match="@N must be"):
        config_overrides("lpm@32", 16)
