"""Every limit the gateway enforces is enforced again by the worker, from the same definitions
(shared/limits.py): a frame straight to a worker port that asks for more is refused with a clear error
at admission, before any work, and the engine keeps serving."""
from __future__ import annotations

import pytest

from services.gateway.limits import Limits
from shared import limits
from tests.support.engine_harness import Harness


@pytest.fixture(scope="module")
def h():
    return Harness()


def _refusal(h: Harness, **kw) -> str:
    rid = h.submit([5, 6, 7], **kw)
    h.run([rid])
    last = h.outputs[rid][-1]
    assert last.finished and last.error and last.refused, last
    return last.error


@pytest.mark.parametrize("kw, words", [
    ({"return_logprob": True, "top_logprobs_num": 1_000_000}, "top_logprobs_num"),
    ({"rid": "r" * (limits.MAX_RID_LEN + 1)}, "rid"),
    ({"logprob_start_len": -7}, "logprob_start_len"),
    ({"sampling": {"n": limits.MAX_N + 1}}, "n must be"),
    ({"sampling": {"stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}}, "stop strings"),
    ({"sampling": {"stop": ["y" * (limits.MAX_STOP_LEN + 1)]}}, "stop strings"),
    ({"sampling": {"stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)}}, "stop_token_ids"),
    ({"sampling": {"logit_bias": {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS + 1)}}}, "logit_bias"),
    ({"sampling": {"regex": "a" * (limits.MAX_GRAMMAR_CHARS + 1)}}, "regex"),
    ({"sampling": {"json_schema": " " * (limits.MAX_GRAMMAR_CHARS + 1)}}, "json_schema"),
])
def test_worker_refuses_what_the_gateway_would(h, kw, words):
    assert words in _refusal(h, **kw)
    ok = h.submit([5, 6, 7], sampling={"max_new_tokens": 2})
    assert h.run([ok])[0]["finish"]["type"] == "length"
    assert h.engine.info()["failed_steps"] == 0  # refused at admission, never reached a step


def test_one_definition():
    gw = Limits()
    assert (gw.max_n, gw.max_top_logprobs) == (limits.MAX_N, limits.MAX_TOP_LOGPROBS)  # rids: models.py's MAX_RID_LEN
