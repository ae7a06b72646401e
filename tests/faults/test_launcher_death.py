"""A launcher that dies, however it dies (SIGKILL: no shutdown code runs), takes its workers with it:
they run in sessions of their own, so only the parent-death signal reaches them."""
from __future__ import annotations

import os
import signal
import time

import pytest

from shared.procfs import alive as _alive
from shared.procfs import children as _children
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


def test_sigkilled_launcher_leaves_no_worker_running():
    s = Stack("--workers", "2")
    workers: list[int] = []
    try:
        workers = _children(s.proc.pid)
        assert len(workers) >= 2, workers
        os.kill(s.proc.pid, signal.SIGKILL)  # the launcher alone, not its group
        s.proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in workers if _alive(p)]
        assert not left, f"workers outlived their launcher: {left}"
    finally:
        for p in workers:  # never leave a worker behind, even when the test fails
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        s.stop()
