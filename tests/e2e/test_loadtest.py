"""The locust load test runs against the real stack (unified, and PD with KV over UCX): no failures, and
TTFT / ITL recorded as their own entries (what the load-test reports are read for)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.support.stack import ROOT

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["unified", "pd"])
def target(request):
    return request.getfixturevalue("base_url" if request.param == "unified" else "pd_stack")


def test_locustfile_runs_clean(target, tmp_path):
    base_url = target if isinstance(target, str) else target.url
    prefix = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "locust", "-f", os.path.join(ROOT, "loadtest", "locustfile.py"),
           "--host", base_url, "--headless", "-u", "3", "-r", "3", "-t", "5s", "--max-tokens", "8",
           "--csv", prefix, "--only-summary"]
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(prefix + "_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["chat (stream)"]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert int(rows["TTFT"]["Request Count"]) > 0 and int(rows["ITL"]["Request Count"]) > 0
