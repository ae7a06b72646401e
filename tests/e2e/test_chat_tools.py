"""Tool calling and reasoning through the real stack (launcher, gateway, worker process) on a tiny random
Qwen3-shaped model served with a Qwen-style template (tool and thinking markup) given by --chat-template
(its tokenizer's own is plain ChatML, so the tool parser is detected from the flag's template). The model
writes random tokens, so what is checked is what must hold whatever it writes: constrained tool choices
always come back as calls whose arguments parse and validate against the function's schema."""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from shared.tokenizer import CHATML_TEMPLATE
from tests.support.chat_templates import QWEN_STYLE, write_chat_model
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "exact": {"type": "boolean"}},
        "required": ["unit", "exact"]}
TOOLS = [{"type": "function", "function": {"name": "get_temperature", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "How warm is it?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_chat")
    path = write_chat_model(str(root / "model"), CHATML_TEMPLATE)
    (root / "qwen.jinja").write_text(QWEN_STYLE)
    stack = Stack("--model-path", path, "--served-model-name", "chat", "--reasoning-parser", "qwen3",
                  "--chat-template", str(root / "qwen.jinja"))
    yield OpenAI(base_url=stack.url + "/v1", api_key="none")
    stack.stop()


def check_calls(calls, allowed):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_tool_choice_always_parse(client, seed):
    resp = client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=200, seed=seed, temperature=1.0)
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message.tool_calls, set(SCHEMAS))
    named = {"type": "function", "function": {"name": "get_temperature"}}
    resp = client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice=named,
                                          max_tokens=200, seed=seed, temperature=1.0)
    assert resp.choices[0].finish_reason == "tool_calls"
    assert len(resp.choices[0].message.tool_calls) == 1
    check_calls(resp.choices[0].message.tool_calls, {"get_temperature"})


def test_streamed_required_call_and_the_next_turn(client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=200, seed=7, stream=True):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    call = calls[0]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # The call and its result go back through the template for the next turn.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"}]
    resp = client.chat.completions.create(model="chat", messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=5)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0


def test_thinking_switch_and_reasoning_field(client):
    resp = client.chat.completions.create(model="chat", messages=ASK, max_tokens=8,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.choices[0].message.content is not None
    # With thinking on, the random model does not open <think>: everything is content, reasoning empty.
    resp = client.chat.completions.create(model="chat", messages=ASK, max_tokens=8, temperature=0)
    msg = resp.choices[0].message
    assert msg.reasoning_content is None and msg.content is not None


def test_chat_template_flag_serves_the_given_template(client):
    plain = client.chat.completions.create(model="chat", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools went into the prompt
