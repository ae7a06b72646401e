"""Tool calling and reasoning output on /v1/chat/completions: the parsers as units (streamed in random
pieces == parsed whole), then through the gateway over a fake worker that answers scripted text (the
model's side is forced; what is tested is the gateway's rendering, constraints and output shapes), and
with the official openai client."""
from __future__ import annotations

import json
import random

import openai
import pytest
import xgrammar as xgr

from services.gateway.api.reasoning import ReasoningParser
from services.gateway.api.tool_grammar import tool_call_ebnf
from services.gateway.api.tool_parsers import new_parser, resolve_parser
from shared.protocol import GenerateRequest
from shared.tokenizer import Tokenizer, build_tiny_hf_tokenizer
from tests.support.chat_templates import LLAMA_STYLE, QWEN_STYLE, SPECIAL_TOKENS
from tests.support.fake_worker import gateway_stack, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        out.append(text[i:i + n])
        i += n
    return out


# ---------------------------------------------------------------- parsers as units
@pytest.mark.parametrize("kind,text,names,content,calls", [
    ("hermes", HERMES_ANSWER, {"get_weather", "get_time"}, "Let me check.\n",
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]),
    ("hermes", HERMES_ANSWER, {"get_time"}, HERMES_ANSWER.split("<tool_call>\n{\"name\": \"get_time")[0],
     [("get_time", "{}")]),  # an unknown function stays content
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", {"f"}, "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}', {"f"}, "",
     [("f", '{"a": {"b": 1}}')]),  # EOS right after the JSON, no closing tag
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', {"f"}, "", [("f", '{"a": [1, 2')]),  # cut off
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', {"f"}, "", [("f", '{"x": 1}')]),
    ("hermes", "No tools needed < > </tool", {"f"}, "No tools needed < > </tool", []),
    ("hermes", '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', {"f"}, "", [("f", '{"a":1}')]),
    ("hermes", '<tool_call>{"name": "\\x", "arguments": {}}</tool_call>', {"f"},
     '<tool_call>{"name": "\\x", "arguments": {}}</tool_call>', []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "a;b", "unit": "f"}}; {"name": "get_time", '
               '"parameters": {}}', {"get_weather", "get_time"}, "",
     [("get_weather", '{"city": "a;b", "unit": "f"}'), ("get_time", "{}")]),
    ("llama3", '<|python_tag|>{"name": "f", "arguments": {"x": "é"}}', {"f"}, "", [("f", '{"x": "é"}')]),
    ("llama3", "The answer is {42}.", {"f"}, "The answer is {42}.", []),
    ("llama3", '{"name": "f", "parameters": {"x": 1}', {"f"}, '{"name": "f", "parameters": {"x": 1}', []),
])
def test_tool_parsers_stream_equals_whole(kind, text, names, content, calls):
    got_content, got_calls = new_parser(kind, names).parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for seed in range(10):
        p = new_parser(kind, names)
        events = [e for piece in pieces(text, seed) for e in p.feed(piece)] + p.finish()
        assert "".join(e[1] for e in events if e[0] == "content") == content
        # A call starts (name known) before any of its argument fragments; fragments add up to the whole.
        started: dict[int, str] = {}
        for e in events:
            if e[0] == "call":
                started[len(started)] = ""
            elif e[0] == "args":
                started[e[1]] += e[2]
        assert [(c.name, started[i]) for i, c in enumerate(p.calls)] == calls


def test_hermes_arguments_stream_as_they_are_written():
    p = new_parser("hermes", {"get_weather"})
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    events = [e for ch in text for e in p.feed(ch)] + p.finish()
    fragments = [e[2] for e in events if e[0] == "args"]
    assert events[0][0] == "call" and len(fragments) > 10
    assert "".join(fragments) == '{"city": "Paris", "unit": "c"}'


@pytest.mark.parametrize("kind,prompt,text,expect", [
    ("qwen3", "", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", ("\nhmm, 2+2\n", "It is 4.")),
    ("qwen3", "", "No thinking here.", ("", "No thinking here.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", ("", "<think>x</think>y")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "open in the prompt</think>done", ("open in the prompt", "done")),
    ("qwen3", "", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("qwen3", "", "<think>I need a tool<tool_call>{}</tool_call>", ("I need a tool", "<tool_call>{}</tool_call>")),
    ("deepseek-r1", "", "thoughts</think>\n\nanswer", ("thoughts", "answer")),
    ("deepseek-r1", "", "<think>thoughts</think>answer", ("thoughts", "answer")),
])
def test_reasoning_parser_stream_equals_whole(kind, prompt, text, expect):
    assert ReasoningParser(kind, prompt).parse(text) == expect
    for seed in range(10):
        for stream_reasoning in (True, False):
            p = ReasoningParser(kind, prompt, stream_reasoning)
            r = c = ""
            for piece in pieces(text, seed):
                dr, dc = p.feed(piece)
                r, c = r + dr, c + dc
            dr, dc = p.finish()
            assert (r + dr, c + dc) == expect


def test_parser_detected_from_the_template():
    assert resolve_parser(None, QWEN_STYLE) == "hermes"
    assert resolve_parser(None, LLAMA_STYLE) == "llama3"
    assert resolve_parser(None, "{{ messages }}") is None
    assert resolve_parser("qwen25", None) == "hermes"


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_unknown_parser_names_are_refused_by_the_flags(flag, capsys):
    from services.gateway.__main__ import build_parser

    args = build_parser().parse_args(["--model-path", "m", flag, "QWEN3"])  # any case
    assert getattr(args, flag[2:].replace("-", "_")) == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", flag, "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["hermes", "llama3"])
def test_required_grammar_accepts_exactly_parseable_calls(kind):
    """The constraint's language, walked by xgrammar's matcher over characters: well-formed calls of the
    offered functions pass, anything else is refused; everything it accepts parses."""
    ebnf = tool_call_ebnf(kind, [t["function"] for t in TOOLS])
    tok = Tokenizer(raw=build_tiny_hf_tokenizer(), eos_token="<|im_end|>")
    from shared.constrained.vocab import build_tokenizer_info

    compiled = xgr.GrammarCompiler(build_tokenizer_info(tok)).compile_grammar(ebnf)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.accept_token(tok.eos_token_ids[0]) and m.is_terminated()
    key = "arguments" if kind == "hermes" else "parameters"
    wrap = (lambda j: f"<tool_call>\n{j}\n</tool_call>") if kind == "hermes" else (lambda j: j)
    sep = "\n" if kind == "hermes" else "; "
    good = [wrap(json.dumps({"name": "get_weather", key: {"city": "Ünï", "unit": "f"}})),
            wrap(json.dumps({"name": "get_time", key: {}})) + sep +
            wrap(json.dumps({"name": "get_weather", key: {"city": "x", "unit": "c"}}))]
    bad = [wrap(json.dumps({"name": "get_weather", key: {"city": "x", "unit": "kelvin"}})),
           wrap(json.dumps({"name": "rm_rf", key: {}})), "Sure! " + good[0]]
    for text in good:
        assert accepts(text), text
        _, calls = new_parser(kind, {"get_weather", "get_time"}).parse(text)
        assert calls and all(isinstance(json.loads(c.arguments), dict) for c in calls)
    for text in bad:
        assert not accepts(text), text


# ---------------------------------------------------------------- through the gateway
def chat_tokenizer(template: str) -> Tokenizer:
    return Tokenizer(raw=build_tiny_hf_tokenizer(), chat_template=template, name="tiny-chat", **SPECIAL_TOKENS)


@pytest.fixture
async def qwen():
    async with gateway_stack(tokenizer=chat_tokenizer(QWEN_STYLE), context_length=4096, tool_parser="hermes",
                             reasoning_parser="qwen3") as s:
        yield s


def last_request(stack) -> GenerateRequest:
    return [m for m in stack.worker.received if isinstance(m, GenerateRequest) and m.rid.startswith("chatcmpl-")][-1]


def prompt_text(stack) -> str:
    return stack.state.tokenizer.decode(last_request(stack).input_ids, skip_special_tokens=False)


async def test_tool_calls_in_response_and_tools_in_the_prompt(qwen):
    qwen.worker.script = HERMES_ANSWER
    r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 200})
    body = await r.json()
    assert r.status == 200, body
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check.\n" and msg["reasoning_content"] is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("function", "get_weather", {"city": "Paris", "unit": "c"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    prompt = prompt_text(qwen)
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt  # the template was given the tools
    assert last_request(qwen).sampling.grammar is None  # auto: unconstrained


async def test_streamed_tool_call_deltas(qwen):
    qwen.worker.script = HERMES_ANSWER
    r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 200,
                                                             "stream": True})
    chunks = [e for e in sse_events(await r.text()) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    # OpenAI's shape: the first delta of a call carries index, id, type, name and empty arguments; then fragments.
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert set(calls[1]) == {"index", "function"} and set(calls[1]["function"]) == {"arguments"}
    args = {}
    for tc in calls:
        args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris", "unit": "c"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


async def test_tool_choice_required_and_named_send_a_grammar(qwen):
    qwen.worker.script = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for choice, names in [("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]:
        r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": choice})
        assert r.status == 200, await r.text()
        ebnf = last_request(qwen).sampling.ebnf
        assert ebnf == tool_call_ebnf("hermes", [t["function"] for t in TOOLS if t["function"]["name"] in names],
                                      parallel=choice == "required")
        assert (await r.json())["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


async def test_tool_choice_none_hides_tools_and_parses_nothing(qwen):
    qwen.worker.script = HERMES_ANSWER
    r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    msg = (await r.json())["choices"][0]["message"]
    assert msg["content"] == HERMES_ANSWER and "tool_calls" not in msg
    assert "<tools>" not in prompt_text(qwen)


async def test_tool_results_in_the_next_turn(qwen):
    qwen.worker.script = "It is 21 degrees."
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": '{"temp": 21}'}]
    r = await qwen.client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    body = await r.json()
    assert body["choices"][0]["message"]["content"] == "It is 21 degrees."
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = prompt_text(qwen)
    expected = qwen.state.tokenizer.apply_chat_template(
        ASK + [{"role": "assistant", "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": '{"temp": 21}'}], tools=TOOLS)
    assert prompt == expected
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in prompt
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in prompt


async def test_reasoning_split_whole_and_streamed(qwen):
    qwen.worker.script = "<think>\nThe user greets me.\n</think>\n\nHello!"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    msg = (await (await qwen.client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "\nThe user greets me.\n"}
    r = await qwen.client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(await r.text()) if e != "[DONE]"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    # Reasoning comes first, content after, never both in one delta.
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    # separate_reasoning: false keeps the markup in content.
    raw = (await (await qwen.client.post("/v1/chat/completions", json={**body, "separate_reasoning": False})).json())
    assert raw["choices"][0]["message"]["content"] == qwen.worker.script


async def test_enable_thinking_false_reaches_the_template(qwen):
    qwen.worker.script = "Just the answer."
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    msg = (await (await qwen.client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    assert msg["content"] == "Just the answer." and "reasoning_content" not in msg
    assert prompt_text(qwen).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_reasoning_then_tool_call(qwen):
    qwen.worker.script = "<think>I should look it up.</think>\n" + HERMES_ANSWER.split("Let me check.\n")[1]
    msg = (await (await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})).json()
           )["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should look it up." and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]


async def test_continue_final_message_and_documents(qwen):
    qwen.worker.script = " more"
    body = {"messages": ASK + [{"role": "assistant", "content": "It is"}], "continue_final_message": True,
            "add_generation_prompt": False, "documents": [{"title": "Atlas", "text": "Paris is in France"}]}
    r = await qwen.client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    prompt = prompt_text(qwen)
    assert prompt.endswith("<|im_start|>assistant\nIt is") and "[1] Atlas: Paris is in France" in prompt


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"functions": [TIME["function"]]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),  # was ignored: silently another template
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}, "messages[1].role"),
])
async def test_bad_tool_requests_are_400(qwen, body, param):
    r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status == 400, await r.text()
    assert (await r.json())["error"]["param"] == param


async def test_tools_without_a_parser_are_refused():
    async with gateway_stack() as s:  # ChatML without tool markup: no parser detected
        r = await s.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert r.status == 400 and "--tool-call-parser" in (await r.json())["error"]["message"]


async def test_tool_schemas_past_the_grammar_cap_are_refused_before_conversion(qwen):
    """tool_choice required converts every function's schema to a grammar (seconds of CPU for a large one):
    schemas longer in all than a json_schema may be are refused first, as a json_schema would be."""
    from shared.limits import MAX_GRAMMAR_CHARS

    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,99}"} for i in range(MAX_GRAMMAR_CHARS // 40)}
    big = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}
    body = {"messages": ASK, "tools": [big], "tool_choice": "required"}
    r = await qwen.client.post("/v1/chat/completions", json=body)
    error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "tools" and "parameters schemas" in error["message"], error
    # tool_choice auto builds no grammar: only the prompt, with the tools in it, is too long here.
    r = await qwen.client.post("/v1/chat/completions", json={"messages": ASK, "tools": [big]})
    assert (await r.json())["error"]["code"] == "context_length_exceeded"


async def test_template_raise_exception_is_a_400(qwen):
    r = await qwen.client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "x"}]})
    assert r.status == 400 and "role developer is not supported" in (await r.json())["error"]["message"]


async def test_official_openai_client_reads_tool_calls_and_reasoning(qwen):
    client = openai.AsyncOpenAI(base_url=qwen.base_url + "v1", api_key="none")
    qwen.worker.script = "<think>Paris, so get_weather.</think>" + HERMES_ANSWER
    resp = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Paris, so get_weather."  # an extra field the client keeps
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    # The client's streaming helper accumulates the deltas into the same message.
    async with client.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message
    assert [(t.id, t.function.name, t.function.arguments) for t in streamed.tool_calls] != []
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert final.choices[0].finish_reason == "tool_calls"
    # docs/api.md's next turn: the client's own message object goes back with the tool's result.
    qwen.worker.script = "21 degrees and sunny."
    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    again = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
    assert again.choices[0].message.content == "21 degrees and sunny."
    prompt = prompt_text(qwen)
    assert '"arguments": {"city": "Paris", "unit": "c"}' in prompt and '{"temp_c": 21}' in prompt
    await client.close()
