"""A regex that forces a huge run (`a{9999999}`) must not make a worker build and re-tokenize it: counts
above shared/limits.MAX_REPEAT are refused up front (gateway and worker alike), and jump-forward cuts a
long forced run to what the request's remaining token budget can use before tokenizing it."""
from __future__ import annotations

import time

import pytest

from shared import limits
from shared.constrained import GrammarCache, jump_forward
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams
from tests.support.engine_harness import Harness, tokenizer


@pytest.mark.parametrize("grammar", [
    {"regex": "a{9999999}"}, {"regex": "(ab){2,9999999}"},
    {"json_schema": '{"type": "array", "items": {"const": 1}, "minItems": 9999999}'},
    {"json_schema": '{"type": "string", "pattern": "^x{9999999}$"}'},
])
def test_huge_counts_are_refused(grammar):
    with pytest.raises(InvalidRequest, match="repetitions"):
        SamplingParams.from_dict(grammar)


def test_worker_refuses_a_huge_forced_run_at_once():
    h = Harness()
    t0 = time.monotonic()
    rid = h.submit([5, 6, 7], sampling={"regex": "a{9999999}", "max_new_tokens": 8})
    h.run([rid])
    assert "repetitions" in (h.outputs[rid][-1].error or "")
    assert time.monotonic() - t0 < 5


class _SpyTokenizer:
    """The tokenizer, recording how much text jump-forward asks it to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0
        spy = self

        class Raw:
            def encode(self, text, **kw):
                spy.longest = max(spy.longest, len(text))
                return tok.raw.encode(text, **kw)
        self.raw = Raw()


def test_jump_forward_tokenizes_only_what_the_budget_can_use():
    tok = tokenizer()
    cache = GrammarCache(tok)
    try:
        state = cache.new_state(cache.compile("regex", "a{%d}" % limits.MAX_REPEAT))
        spy = _SpyTokenizer(tok)
        jf = jump_forward(state, [], spy, budget=16)
        assert jf is not None and 0 < len(jf.new_ids) <= 16
        assert spy.longest <= 32 * state.vocab.max_token_bytes, spy.longest
    finally:
        cache.close()


def test_a_long_but_allowed_forced_run_finishes_quickly():
    h = Harness()
    t0 = time.monotonic()
    rid = h.submit([5, 6, 7], sampling={"regex": "a{%d}" % limits.MAX_REPEAT, "max_new_tokens": 12})
    res = h.run([rid])[0]
    assert res["finish"]["type"] == "length" and set(res["text"]) == {"a"}
    assert time.monotonic() - t0 < 10
