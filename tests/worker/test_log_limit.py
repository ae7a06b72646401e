"""shared/log_limit.py on a fake clock: per kind, the first warning of a window is logged and the rest are
counted; the first one after the window says how many were left out. (The worker's flood of refused
connections, tests/faults/test_process_cleanup.py, checks the wiring on a real process.)"""
from __future__ import annotations

import logging

from shared import log_limit
from shared.log_limit import LimitedWarning


def _limited(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(log_limit.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger="log-limit-test")
    return LimitedWarning(logging.getLogger("log-limit-test"), interval_s=10.0), now


def test_a_window_logs_one_warning_a_kind_and_the_next_window_counts_the_rest(monkeypatch, caplog):
    limited, now = _limited(monkeypatch, caplog)
    for i in range(500):
        limited.warning("garbage", "refusing a connection from %s: garbage", f"peer{i}")
        limited.warning("timeout", "refusing a connection from %s: hello timed out", f"peer{i}")
    assert [r.getMessage() for r in caplog.records] == [
        "refusing a connection from peer0: garbage", "refusing a connection from peer0: hello timed out"]
    now[0] += 9.9
    limited.warning("garbage", "refusing a connection from %s: garbage", "late")
    assert len(caplog.records) == 2  # still in the window: counted
    now[0] += 0.2
    limited.warning("garbage", "refusing a connection from %s: garbage", "next")
    assert caplog.records[-1].getMessage() == (
        "refusing a connection from next: garbage (and 500 more like it since the last one logged)")
    limited.warning("garbage", "refusing a connection from %s: garbage", "again")
    assert len(caplog.records) == 3


def test_kinds_past_the_limit_share_one_window(monkeypatch, caplog):
    limited, now = _limited(monkeypatch, caplog)
    for i in range(100):  # a peer varying the text does not get a window per variant
        limited.warning(f"refused: reason {i}", "refused %d", i)
    assert len(caplog.records) == log_limit._MAX_KINDS + 1
    now[0] += 11
    limited.warning("refused: reason 99", "refused %d", 99)
    assert len(caplog.records) == log_limit._MAX_KINDS + 2
