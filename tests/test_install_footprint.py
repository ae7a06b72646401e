"""UCX/RMM are an optional install (`.[pd]`): the embedded server runs without them, and asking for PD
without them is a clear message naming the install command, not an ImportError deep in a worker."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import requests

from tests.support.stack import ROOT, Proc, free_port

pytestmark = pytest.mark.e2e

# Makes ucxx and its RAPIDS wheels unimportable in this process and every child (workers inherit
# PYTHONPATH): what a machine without the `pd` extra looks like.
_BLOCKER = textwrap.dedent("""
    import sys

    class _NotInstalled:
        BLOCKED = ("ucxx", "rmm", "libucx", "libucxx", "librmm")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, _NotInstalled())
""")


def _env_without_ucx(tmp_path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    path = os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")


def test_embedded_server_serves_without_ucx(tmp_path):
    port = free_port()
    env = _env_without_ucx(tmp_path)
    check = subprocess.run([sys.executable, "-c", "import ucxx"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'ucxx'" in check.stderr  # the blocker works
    proc = Proc("services.launch", "--model-path", "tiny-random", "--port", str(port), env=env, ready="READY ")
    try:
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "tiny-random", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.stop()


def test_pd_without_ucx_names_the_extra(tmp_path):
    env = _env_without_ucx(tmp_path)
    r = subprocess.run([sys.executable, "-m", "services.launch", "--model-path", "tiny-random", "--topology", "pd"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'pip install -e ".[pd]"' in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "services.worker", "--model-path", "tiny-random", "--role", "decode"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'pip install -e ".[pd]"' in r.stderr and "Traceback" not in r.stderr, r.stderr
