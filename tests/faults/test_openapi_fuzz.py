"""schemathesis against the gateway's own /openapi.json, real worker behind it: valid and invalid bodies
generated from the published schemas for every route, derandomized and bounded (a few dozen examples
per operation). Whatever comes in, the answer is never a 5xx (503 aside, there is one healthy worker).
schemathesis' coverage phase is off: it ignores max_examples ("every case the schema defines"), which on
the recursive program schema is minutes of case generation, past pytest's 300 s timeout on a busy machine."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from tests.faults.procs import gateway, worker

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def api_schema():
    w, host, port = worker()
    # A small context bounds every generation the fuzzer can ask for (prompt + output <= 48 tokens).
    g, url = gateway(f"{host}:{port}", "--context-length", "48")
    try:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        schema.config.phases.update(phases=["examples", "fuzzing"])
        yield schema
    finally:
        g.stop()
        w.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=20, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text[:500])
