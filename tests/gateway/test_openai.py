"""OpenAI-compatible endpoints of the gateway over a fake worker: response shapes, streaming framing,
n > 1, echo + logprobs, response_format, every refused input, and the official `openai` client."""
import asyncio
import json

import openai
import pytest

from shared.protocol import GenerateRequest
from tests.support.fake_worker import fake_logprob, gateway_stack, sse_events

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def stack():
    async with gateway_stack() as s:
        yield s


def generated(stack, rid_prefix=""):
    return [m for m in stack.worker.received if isinstance(m, GenerateRequest)
            and not m.rid.startswith("health-") and m.rid.startswith(rid_prefix)]


async def post(stack, path, body):
    r = await stack.client.post(path, json=body)
    return r.status, await r.json()


async def stream(stack, path, body):
    r = await stack.client.post(path, json={**body, "stream": True})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(await r.text())


# ---------------------------------------------------------------- completions
async def test_completion_text_usage_and_model(stack):
    tok = stack.state.tokenizer
    status, body = await post(stack, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5})
    assert status == 200
    ids = tok.encode("Hello")
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["text"] == tok.decode(stack.worker.expected_ids(ids, 5))
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5, "total_tokens": len(ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # The default budget is OpenAI's 16 tokens.
    _, body = await post(stack, "/v1/completions", {"prompt": "Hello"})
    assert body["usage"]["completion_tokens"] == 16


async def test_completion_prompt_forms_and_choice_order(stack):
    tok = stack.state.tokenizer
    expect = lambda ids: tok.decode(stack.worker.expected_ids(ids, 3))  # noqa: E731
    a, b = tok.encode("Hello"), tok.encode("The quick")
    for prompt, prompts in [(["Hello", "The quick"], [a, b]), (a, [a]), ([a, b], [a, b])]:
        status, body = await post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
        assert status == 200
        assert [c["text"] for c in body["choices"]] == [expect(p) for p in prompts]
        assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


async def test_n_fans_out_with_suffixed_rids_and_distinct_seeds(stack):
    status, body = await post(stack, "/v1/completions",
                              {"prompt": ["Hello", "world"], "n": 3, "max_tokens": 4, "seed": 7})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == list(range(6))
    reqs = generated(stack, "cmpl-")
    assert len(reqs) == 6
    assert sorted(r.rid.rsplit("-", 2)[-2:][1] for r in reqs) == ["0", "0", "1", "1", "2", "2"]
    assert sorted(r.sampling.seed for r in reqs) == [7, 7, 8, 8, 9, 9]
    texts = [c["text"] for c in body["choices"][:3]]
    assert len(set(texts)) == 3  # the fake worker's output depends on the seed
    assert body["usage"]["completion_tokens"] == 24
    # The prompt is billed once per prompt, not once per choice.
    tok = stack.state.tokenizer
    assert body["usage"]["prompt_tokens"] == len(tok.encode("Hello")) + len(tok.encode("world"))


async def test_echo_with_logprobs_and_zero_max_tokens(stack):
    """lm-eval-harness's loglikelihood request: the prompt back with a logprob for every token but the first."""
    tok = stack.state.tokenizer
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    status, body = await post(stack, "/v1/completions",
                              {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert status == 200
    [choice] = body["choices"]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(t) for t in ids]
    assert lp["token_logprobs"] == [None] + [fake_logprob(p) for p in range(1, len(ids))]
    assert lp["top_logprobs"][0] is None and all(len(d) == 1 for d in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(prompt) - len(lp["tokens"][-1])
    assert body["usage"]["completion_tokens"] == 0
    [req] = generated(stack, "cmpl-")
    assert req.return_logprob and req.logprob_start_len == 0 and req.top_logprobs_num == 1


async def test_echo_logprobs_with_generated_tokens(stack):
    tok = stack.state.tokenizer
    status, body = await post(stack, "/v1/completions",
                              {"prompt": "Hello", "echo": True, "logprobs": 2, "max_tokens": 3})
    lp = body["choices"][0]["logprobs"]
    n_prompt = len(tok.encode("Hello"))
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][n_prompt:] == [fake_logprob(k) for k in range(3)]
    assert all(len(d) == 2 for d in lp["top_logprobs"][n_prompt:])
    assert body["choices"][0]["text"].startswith("Hello")
    assert lp["text_offset"][n_prompt] == len("Hello")


async def test_stop_string_trims_and_reports_stop(stack):
    tok = stack.state.tokenizer
    full = tok.decode(stack.worker.expected_ids(tok.encode("Hello"), 10))
    stop = full.split()[2]
    _, body = await post(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 10, "stop": [stop]})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.index(stop)]


async def test_completion_stream_framing_and_usage(stack):
    body = {"prompt": "Hello", "max_tokens": 6, "stream_options": {"include_usage": True}}
    events = await stream(stack, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    _, plain = await post(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 6})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    # Without include_usage there is no usage key and no usage chunk.
    events = await stream(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert "usage" not in events[0] and all(e == "[DONE]" or e["choices"] for e in events)


async def test_completion_stream_echo_and_n(stack):
    events = await stream(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n": 2, "echo": True,
                                                     "seed": 1})
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for e in events[:-1]:
        [c] = e["choices"]
        texts[c["index"]] += c["text"]
        finishes[c["index"]].append(c["finish_reason"])
    assert all(t.startswith("Hello") for t in texts.values()) and texts[0] != texts[1]
    assert all(f[-1] == "length" and set(f[:-1]) <= {None} for f in finishes.values())


# ---------------------------------------------------------------- chat
async def test_chat_completion(stack):
    tok = stack.state.tokenizer
    status, body = await post(stack, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 4})
    assert status == 200 and body["object"] == "chat.completion"
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": tok.decode(stack.worker.expected_ids(ids, 4))}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    [req] = generated(stack, "chatcmpl-")
    assert req.input_ids == ids


async def test_chat_max_completion_tokens_and_default_budget(stack):
    _, body = await post(stack, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2})
    assert body["usage"]["completion_tokens"] == 2
    # Without a budget the request may fill the context.
    _, body = await post(stack, "/v1/chat/completions", {"messages": CHAT})
    assert body["usage"]["total_tokens"] == stack.state.context_length


async def test_chat_text_parts_and_logprobs(stack):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    status, body = await post(stack, "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [fake_logprob(k) for k in range(3)]
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]


async def test_chat_stream_format(stack):
    events = await stream(stack, "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 4, "n": 2, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1]["delta"] == {}
        assert all(set(m["delta"]) == {"content"} for m in mine[1:-1])
    # Role chunks come before any content.
    assert all("role" in c["choices"][0]["delta"] for c in chunks[:2])


async def test_response_format_maps_to_json_schema(stack):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"type": "json_object"}, {"type": "object"}),
             ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}, schema),
             ({"type": "text"}, None)]
    for fmt, expect in cases:
        stack.worker.received.clear()
        status, _ = await post(stack, "/v1/chat/completions",
                               {"messages": CHAT, "max_tokens": 1, "response_format": fmt})
        assert status == 200
        [req] = generated(stack, "chatcmpl-")
        got = req.sampling.json_schema
        assert (json.loads(got) if got else None) == expect


async def test_vllm_structured_outputs_name_the_grammar(stack):
    """vLLM's `structured_outputs` (and its older `guided_*` fields) constrain the output as they do
    there: each becomes the request's grammar; its options that change nothing here are accepted."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, "json_schema", schema),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json_schema", schema),
        ({"structured_outputs": {"json_object": True}}, "json_schema", {"type": "object"}),
        ({"structured_outputs": {"choice": ["yes", 'say "no"', "é"]}}, "ebnf", 'root ::= "yes" | "say \\"no\\"" | "é"'),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "ebnf", 'root ::= "a" | "b"'),
        ({"structured_outputs": {"disable_fallback": True}}, None, None),
        ({"structured_outputs": {"json_object": False}}, None, None),
        ({"structured_outputs": {"json": True}}, "json_schema", True),
        ({"guided_regex": "[a-z]+", "guided_decoding_backend": "xgrammar"}, "regex", "[a-z]+"),
        ({"guided_json": schema}, "json_schema", schema),
        ({"guided_choice": ["left", "right"]}, "ebnf", 'root ::= "left" | "right"'),
        ({"guided_grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
        ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),  # completions too
    ]
    for extra, field, expect in cases:
        for path, base, prefix in (("/v1/completions", {"prompt": "hi"}, "cmpl-"),
                                   ("/v1/chat/completions", {"messages": CHAT}, "chatcmpl-")):
            stack.worker.received.clear()
            status, body = await post(stack, path, {**base, "max_tokens": 1, **extra})
            assert status == 200, (extra, body)
            [req] = generated(stack, prefix)
            grammars = {k: getattr(req.sampling, k) for k in ("regex", "json_schema", "ebnf")
                        if getattr(req.sampling, k) is not None}
            if field is None:
                assert grammars == {}, extra
                continue
            assert list(grammars) == [field], extra
            got = json.loads(grammars[field]) if field == "json_schema" else grammars[field]
            assert got == expect, extra


async def test_vllm_extras_stop_strings_and_prompt_truncation(stack):
    """include_stop_str_in_output is no_stop_trim; truncate_prompt_tokens keeps the prompt's last k tokens
    (what the worker is sent, and what usage bills); features we lack set to their off values are fine."""
    for value in (True, False):
        stack.worker.received.clear()
        status, _ = await post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["x"],
                                                          "include_stop_str_in_output": value})
        assert status == 200
        assert generated(stack, "cmpl-")[0].sampling.no_stop_trim is value
    ids = [11, 12, 13, 14, 15]
    long = list(range(10, 310))  # longer than the fake stack's 256-token context: truncated, not refused
    for prompt, k, expect in ((ids, 2, ids[-2:]), (ids, 5, ids), (ids, 9, ids), (ids, -1, ids), (long, 8, long[-8:])):
        stack.worker.received.clear()
        status, body = await post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": k,
                                                             "use_beam_search": False, "prompt_logprobs": None})
        assert status == 200, body
        assert generated(stack, "cmpl-")[0].input_ids == expect
        assert body["usage"]["prompt_tokens"] == len(expect)
    stack.worker.received.clear()
    status, _ = await post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    full = generated(stack, "chatcmpl-")[0].input_ids
    stack.worker.received.clear()
    status, _ = await post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": 3})
    assert status == 200 and generated(stack, "chatcmpl-")[0].input_ids == full[-3:]


# ---------------------------------------------------------------- refusals
BAD_INPUTS = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 42}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10 ** 6]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [5, -1]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [5, 10 ** 30]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [5, True]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [5, 6.0]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [[5], [6, False]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": "high"}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("/v1/completions", {"prompt": [5] * 256}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 57}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", ["not", "an", "object"], 400, None, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": {}, "content": ""}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": ""}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]", None),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5}, 400, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format.type", None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", None),
    ("/v1/chat/completions", {"messages": CHAT, "regex": "a+", "response_format": {"type": "json_object"}},
     400, "regex", None),
    # vLLM's structured outputs: one constraint, nothing we cannot honour, no unknown keys, no clash.
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs.choice", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}}, 400,
     "structured_outputs.whitespace_pattern", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400,
     "structured_outputs.structural_tag", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regx": "a"}}, 400, "structured_outputs.regx", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": 5}}, 400, "structured_outputs.json", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": False}}, 400, "structured_outputs.json", None),
    ("/v1/completions", {"prompt": "x", "guided_json": False}, 400, "guided_json", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json_object": "yes"}}, 400,
     "structured_outputs.json_object", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"disable_fallback": "no"}}, 400,
     "structured_outputs.disable_fallback", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": "regex"}, 400, "structured_outputs", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs.regex", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a{1000000}"}}, 400,
     "structured_outputs.regex", None),
    ("/v1/chat/completions", {"messages": CHAT, "guided_regex": "a{1000000}"}, 400, "guided_regex", None),
    ("/v1/completions", {"prompt": "x", "guided_choice": [1, 2]}, 400, "guided_choice", None),
    ("/v1/completions", {"prompt": "x", "guided_regex": ""}, 400, "guided_regex", None),
    ("/v1/completions", {"prompt": "x", "guided_json": "{bad"}, 400, "guided_json", None),
    ("/v1/completions", {"prompt": "x", "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern", None),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "regex": "b"}, 400, "regex", None),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, 400,
     "guided_regex", None),
    ("/v1/chat/completions", {"messages": CHAT, "guided_json": {}, "response_format": {"type": "json_object"}},
     400, "guided_json", None),
    # vLLM's other extras: what we lack is refused, not ignored.
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "bad_words": ["no"]}, 400, "bad_words", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [5]}, 400, "allowed_token_ids", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": "3"}, 400, "truncate_prompt_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "truncate_prompt_tokens": True}, 400, "truncate_prompt_tokens", None),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output", None),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": True, "no_stop_trim": False}, 400,
     "include_stop_str_in_output", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 250}, 400, "max_tokens", "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_INPUTS)
async def test_bad_input_is_a_4xx_with_openai_error(stack, path, body, status, param, code):
    r = await stack.client.post(path, json=body)
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if code:
        assert err["code"] == code
    if code == "context_length_exceeded":  # clients match on the text too
        assert code in err["message"]
    assert not generated(stack, "c")  # refused before reaching a worker


@pytest.mark.parametrize("raw,fragment", [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b"[" * 100 + b"]" * 100, "deeper"),
    (b'{"prompt": ' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"}", "deeper"),
    (b"[" * 100000 + b"]" * 100000, "deeper"),
    (b"\xff\xfe", "malformed JSON"),
])
async def test_malformed_and_deep_json(stack, raw, fragment):
    r = await stack.client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400
    assert fragment in (await r.json())["error"]["message"]


async def test_a_lone_surrogate_escape_is_a_400_and_other_escapes_pass(stack):
    r = await stack.client.post("/v1/completions", headers={"Content-Type": "application/json"},
                                data=b'{"model": "tiny", "prompt": "a \\ud800 b", "max_tokens": 2}')
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["code"] == "invalid_unicode" and err["param"] == "prompt"
    r = await stack.client.post("/v1/completions", headers={"Content-Type": "application/json"},
                                data=b'{"model": "tiny", "prompt": "a\\n\\u00e9 \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status == 200, await r.text()


async def test_body_over_the_limit_is_413(stack):
    limit = stack.state.limits.max_body_bytes
    r = await stack.client.post("/v1/completions", data=b'{"prompt": "' + b"a" * limit + b'"}',
                                headers={"Content-Type": "application/json"})
    assert r.status == 413
    assert (await r.json())["error"]["code"] == "request_too_large"


async def test_unknown_route_and_method_are_json_errors(stack):
    r = await stack.client.get("/v1/nothing")
    assert r.status == 404 and "error" in await r.json()
    r = await stack.client.get("/v1/completions")
    assert r.status == 405 and "error" in await r.json()


async def test_worker_error_mid_stream_is_one_error_event(stack):
    stack.worker.error_after = 2
    r = await stack.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "stream": True})
    events = sse_events(await r.text())
    assert "[DONE]" not in events
    assert "error" in events[-1] and events[-1]["error"]["message"] == "worker exploded"
    assert sum("error" in e for e in events) == 1
    contents = [e["choices"][0]["delta"]["content"] for e in events if "choices" in e and e["choices"][0]["delta"].get("content")]
    # The two tokens before the error, as one or two events (queued tokens may arrive as one increment).
    assert 1 <= len(contents) <= 2 and len("".join(contents).split()) == 2, contents


async def test_worker_refusal_and_lost_worker_non_stream(stack):
    stack.worker.refuse = "grammar does not compile"
    status, body = await post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 400 and body["error"]["message"] == "grammar does not compile"
    stack.worker.refuse = None
    stack.worker.token_delay = 0.05
    task = asyncio.create_task(post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 100}))
    await asyncio.sleep(0.2)
    await stack.worker.drop_connections()
    status, body = await asyncio.wait_for(task, 5)
    assert status == 503 and body["error"]["code"] == "worker_unavailable"


async def test_a_busy_grammar_compiler_is_503_on_the_gateway_and_on_a_worker(stack):
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "array"}}}
    body = {"prompt": "x", "max_tokens": 2, "response_format": schema}
    grammars = stack.state.grammars  # the gateway's, which checks every grammar before dispatch
    grammars._abandoned.update(("regex", f"stand-in {i}") for i in range(grammars.max_abandoned))
    try:
        for streamed in (False, True):
            r = await stack.client.post("/v1/completions", json={**body, "stream": streamed})
            err = (await r.json())["error"]
            assert r.status == 503 and "busy" in err["message"], (streamed, r.status, err)
            assert err["type"] == "service_unavailable" and err["code"] == "server_overloaded"
    finally:
        grammars._abandoned.clear()
    assert not generated(stack, "cmpl-")
    status, _ = await post(stack, "/v1/completions", body)  # not remembered as a bad grammar
    assert status == 200
    # A worker's compiler busy: the same 503; in a stream it is the error event a worker's 400 would be.
    stack.worker.refuse, stack.worker.overloaded = "the grammar compiler is busy", True
    status, out = await post(stack, "/v1/completions", body)
    assert status == 503 and out["error"]["code"] == "server_overloaded"
    assert out["error"]["type"] == "service_unavailable"
    [event] = await stream(stack, "/v1/completions", body)
    assert event["error"]["code"] == "server_overloaded"


async def test_models(stack):
    body = await (await stack.client.get("/v1/models")).json()
    [m] = body["data"]
    assert m["id"] == "tiny" and m["object"] == "model" and m["owned_by"] and m["max_model_len"] == 256


async def test_model_path_is_accepted_as_model_name(stack):
    status, _ = await post(stack, "/v1/completions", {"model": "tiny-random", "prompt": "x", "max_tokens": 1})
    assert status == 200


# ---------------------------------------------------------------- API keys
async def test_api_keys():
    async with gateway_stack(api_key="sekret", admin_api_key="root") as s:
        body = {"prompt": "x", "max_tokens": 1}
        assert (await s.client.post("/v1/completions", json=body)).status == 401
        bad = {"Authorization": "Bearer wrong"}
        assert (await s.client.post("/v1/completions", json=body, headers=bad)).status == 401
        ok = {"Authorization": "Bearer sekret"}
        assert (await s.client.post("/v1/completions", json=body, headers=ok)).status == 200
        assert (await s.client.post("/generate", json={"text": "x"})).status == 401
        assert (await s.client.post("/flush_cache", headers=ok)).status == 401
        assert (await s.client.post("/flush_cache", headers={"Authorization": "Bearer root"})).status == 200
        assert (await s.client.get("/health")).status == 200  # probes stay open


# ---------------------------------------------------------------- the official client
async def test_official_openai_client(stack):
    client = openai.AsyncOpenAI(base_url=stack.base_url + "v1", api_key="unused", max_retries=0)
    try:
        comp = await client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=1)
        assert comp.choices[0].finish_reason == "length" and len(comp.choices[0].logprobs.tokens) == 4
        assert comp.usage.prompt_tokens_details.cached_tokens == 0

        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=5, stream=True, stream_options={"include_usage": True})]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
        plain = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5)
        assert text == plain.choices[0].message.content

        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=1)
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x")
    finally:
        await client.close()
