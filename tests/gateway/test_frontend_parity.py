"""What SGLang's and OpenAI's clients expect from the server beyond the basics: the next position's top-k
from a prefill-only request, `stop_regex`, `GET /v1/models/{id}`, string-or-null error codes, unknown
sampling parameters said out loud (or refused under --strict)."""
from __future__ import annotations

import re

import openai
import pytest
import requests
from openai import OpenAI

from services.gateway.limits import Limits
from tests.support.fake_worker import gateway_stack


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=60)


# ---------------------------------------------------------------- gateway only (fake worker)
async def test_model_retrieve_and_unknown_model():
    async with gateway_stack() as s:
        for model_id in ("tiny", "tiny-random"):
            r = await s.client.get(f"/v1/models/{model_id}")
            assert r.status == 200
            card = await r.json()
            assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == 256
        r = await s.client.get("/v1/models/org/not-served")
        assert r.status == 404
        err = (await r.json())["error"]
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error" and "not-served" in err["message"]


async def test_http_errors_carry_string_or_null_codes():
    async with gateway_stack() as s:
        for method, path, status in (("GET", "/nowhere", 404), ("GET", "/generate", 405),
                                     ("DELETE", "/v1/chat/completions", 405)):
            r = await s.client.request(method, path)
            assert r.status == status
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] is None or isinstance(err["code"], str), err
        r = await s.client.request("GET", "/generate")
        assert "POST" in r.headers["Allow"]


async def test_unknown_sampling_parameters_warn_or_refuse_under_strict():
    async with gateway_stack() as s:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1, "fancy_knob": 3, "zeta": 1, "top_k": 2}}
        r = await s.client.post("/generate", json=body)
        assert r.status == 200
        assert "fancy_knob, zeta" in r.headers["Warning"] and r.headers["Warning"].startswith("299 ")
        r = await s.client.post("/generate", json={**body, "stream": True})
        assert r.status == 200 and "fancy_knob" in r.headers["Warning"]
        await r.read()
        r = await s.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        assert "Warning" not in r.headers
        # The client's key names cannot break or inject the header: newlines, quotes, NUL and non-Latin-1
        # characters come back escaped (this request used to be dropped without an answer).
        odd = {"a\r\nX-Evil: 1": 1, 'q"\\': 2, "\u0000\u00fc\ud83d\ude00": 3, "long" * 40: 4}
        for stream in (False, True):
            r = await s.client.post("/generate", json={"text": "x", "stream": stream,
                                                       "sampling_params": {"max_new_tokens": 1, **odd}})
            assert r.status == 200 and "X-Evil" not in r.headers
            await r.read()
            warning = r.headers["Warning"]
            assert warning.isascii() and warning.isprintable(), warning
            assert "a\\r\\nX-Evil: 1" in warning and 'q\\"\\\\' in warning and "\\u0000\\u00fc" in warning
            assert ("long" * 16) in warning and ("long" * 17) not in warning
        many = {f"k{i:02d}": i for i in range(20)}
        r = await s.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1, **many}})
        assert r.headers["Warning"].endswith('k15 and 4 more"')
    async with gateway_stack(limits=Limits(strict_sampling_params=True)) as s:
        r = await s.client.post("/generate", json=body)
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["param"] == "fancy_knob" and err["code"] == "unknown_parameter"
        r = await s.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1,
                                                                                   "sampling_seed": 3}})
        assert r.status == 200


@pytest.mark.parametrize("stop_regex", ["(", 5, ["a"] * 17, "x" * 300, [""]])
async def test_bad_stop_regex_is_400(stop_regex):
    async with gateway_stack() as s:
        r = await s.client.post("/generate", json={"text": "x", "sampling_params": {"stop_regex": stop_regex}})
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "stop_regex"


# ---------------------------------------------------------------- the real stack
@pytest.mark.e2e
def test_prefill_only_request_answers_the_next_positions_top_k(base_url):
    """SGLang's chain-of-thought decoding branches on this: max_new_tokens 0 still reports the top-k of
    the position after the prompt."""
    prompt = "Question: what comes next? Answer:"
    probe = post(base_url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0},
                                         "return_logprob": True, "top_logprobs_num": 3,
                                         "return_text_in_logprobs": True}).json()
    meta = probe["meta_info"]
    assert probe["output_ids"] == [] and meta["output_token_logprobs"] == []
    (tops,) = meta["output_top_logprobs"]
    assert len(tops) == 3 and all(isinstance(e[0], float) and isinstance(e[2], str) for e in tops)
    assert tops[0][0] >= tops[1][0] >= tops[2][0]
    # The same position, sampled greedily: its first token is the probe's best, with the same top-k.
    step = post(base_url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                        "return_logprob": True, "top_logprobs_num": 3}).json()
    assert step["output_ids"] == [tops[0][1]]
    assert [e[1] for e in step["meta_info"]["output_top_logprobs"][0]] == [e[1] for e in tops]
    assert step["meta_info"]["output_top_logprobs"][0][0][0] == pytest.approx(tops[0][0], abs=1e-4)


@pytest.mark.e2e
def test_stop_regex_stops_at_the_first_match(base_url):
    prompt = "The stop_regex test prompt"
    free = post(base_url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 24,
                                                                            "temperature": 0}}).json()
    text = free["text"]
    assert len(text) >= 8
    # A pattern whose first match ends inside the output: two characters seen at position 4..5.
    pattern = re.escape(text[4]) + "."
    m = re.search(pattern, text)
    stopped = post(base_url, "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop_regex": [r"\A\Z never", pattern]}}).json()
    assert stopped["text"] == text[:m.end()]  # the match stays in the text, as SGLang's server does
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": m.group(0)}
    assert stopped["meta_info"]["completion_tokens"] < free["meta_info"]["completion_tokens"]
    # Streaming ends at the same place.
    with requests.post(base_url + "/generate", json={"text": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "stop_regex": pattern}}, stream=True, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    assert requests.models.complexjson.loads(events[-2])["text"] == text[:m.end()]


@pytest.mark.e2e
def test_openai_models_retrieve_through_the_stack(base_url):
    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    assert client.models.retrieve("tiny-random").id == "tiny-random"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nonexistent")
    assert e.value.code == "model_not_found"
