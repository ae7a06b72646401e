"""Session fixtures over real processes (tests/support/stack.py), and the `gpu` marker's skip.

Markers (registered in pyproject.toml, --strict-markers): `gpu` for a test that needs CUDA (skipped here
without it; the GPU run is `pytest -m gpu`), `e2e` for a test that starts the services or redis-server as
real processes (`-m "not e2e"` for a quick in-process pass)."""
from __future__ import annotations

import pytest

from tests.support.stack import RedisServer, Stack


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack():
    s = Stack()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def base_url(stack) -> str:
    return stack.url


@pytest.fixture(scope="session")
def pd_stack():
    """Gateway + one prefill and one decode worker process, KV pages over UCX."""
    s = Stack("--topology", "pd")
    yield s
    s.stop()
