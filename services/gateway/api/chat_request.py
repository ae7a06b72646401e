"""What a decoded chat request (api/models.py's ChatRequest) asks of the template and the output parsers:
its messages in the shape chat templates read, the tools the template shows and the grammar that
tool_choice required / named imposes, and the reasoning switches. The checks here are the ones a type
cannot say (unique tool names, a named choice among them, a parser for the model's call format); the
rendering itself is shared/chat_template.py's."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.api.models import ChatRequest, Message
from services.gateway.http.errors import bad_request
from services.gateway.api.grammar import GRAMMAR_FIELDS
from services.gateway.api.tool_grammar import tool_call_ebnf
from shared.limits import MAX_GRAMMAR_CHARS


@dataclass
class ChatSpec:
    messages: list[dict]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None          # as the template sees them (None: not offered)
    documents: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tool_parser: str | None = None           # parse tool calls out of the answer with this format
    tool_names: set[str] = field(default_factory=set)
    tool_ebnf: str | None = None             # constraint for tool_choice required / named
    reasoning_parser: str | None = None
    stream_reasoning: bool = True


def parse_chat(body: ChatRequest, tool_parser: str | None, reasoning_parser: str | None) -> ChatSpec:
    if body.chat_template is not None:
        raise bad_request("a chat_template in the request is not supported; the server's template (its model's, "
                          "or --chat-template at start) renders every chat", "chat_template")
    kwargs = body.chat_template_kwargs or {}
    spec = ChatSpec(messages=[_message(m, f"messages[{i}]") for i, m in enumerate(body.messages)],
                    template_kwargs=dict(kwargs), documents=body.documents,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message)
    if spec.continue_final_message:
        if spec.messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
        spec.add_generation_prompt = False
    _tools(body, spec, tool_parser)
    # enable_thinking: false in the template's kwargs means there is no reasoning to split off.
    if reasoning_parser and body.separate_reasoning and kwargs.get("enable_thinking") is not False:
        spec.reasoning_parser = reasoning_parser
        spec.stream_reasoning = body.stream_reasoning
    return spec


def _message(m: Message, param: str) -> dict:
    out: dict[str, Any] = {"role": m.role}
    calls = m.tool_calls if m.role == "assistant" else None
    if calls is not None:
        out["tool_calls"] = [_history_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if m.content is None:
        # Templates concatenate content; a call-only assistant turn keeps it absent, as transformers does.
        if m.role != "assistant":
            raise bad_request(f"{param}.content must be a string or a list of text parts", f"{param}.content")
        out["content"] = None if calls else ""
    else:
        out["content"] = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
    for key in ("name", "tool_call_id", "reasoning_content"):
        if (value := getattr(m, key)) is not None:
            out[key] = value
    return out


def _history_call(call, param: str) -> dict:
    """An earlier call, its JSON-text arguments as an object: templates write them with tojson."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{param}.function.arguments is not valid JSON", f"{param}.function.arguments") from None
    entry = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


def _tools(body: ChatRequest, spec: ChatSpec, parser: str | None) -> None:
    for legacy in ("functions", "function_call"):
        if getattr(body, legacy) is not None:
            raise bad_request(f"'{legacy}' is deprecated and not supported; use 'tools' and 'tool_choice'", legacy)
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return
    functions = [msgspec.to_builtins(t.function) for t in body.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if choice == "none":
        return  # as SGLang: the template is not shown tools the model may not call
    if choice is None or choice == "auto":
        constrained = []
    elif choice == "required":
        constrained = functions
    elif choice.function.name in names:
        constrained = [f for f in functions if f["name"] == choice.function.name]
    else:
        raise bad_request("tool_choice must name one of the given functions: "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if parser is None:
        raise bad_request("this server cannot parse tool calls for its model: start the gateway with "
                          "--tool-call-parser (hermes or llama3)", "tools")
    spec.tools = [{"type": "function", "function": f} for f in functions]
    spec.tool_parser, spec.tool_names = parser, set(names)
    if constrained:
        clash = next((k for k in GRAMMAR_FIELDS if getattr(body, k) is not None), None)
        if clash:
            raise bad_request(f"'{clash}' cannot be combined with tool_choice "
                              f"'{choice if isinstance(choice, str) else 'function'}'", "tool_choice")
        # As a json_schema's cap: converting schemas to a grammar costs CPU seconds per few hundred KB.
        if len(json.dumps([f.get("parameters") for f in constrained])) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"the functions' parameters schemas are longer than {MAX_GRAMMAR_CHARS} characters "
                              "in all (tool_choice builds a grammar from them)", "tools")
        try:
            spec.tool_ebnf = tool_call_ebnf(parser, constrained, parallel=body.parallel_tool_calls
                                            and isinstance(choice, str))
        except Exception as e:  # xgrammar reports a schema it cannot use as RuntimeError
            raise bad_request(f"a function's parameters schema cannot be used: {str(e).strip()[:300]}",
                              "tools") from None
