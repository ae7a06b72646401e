"""What a chat request asks of the template and the output parsers: its messages in the shape chat
templates read, its tools and tool_choice, chat_template_kwargs and the reasoning switches. Every check
raises a 400 naming the field; the rendering itself is shared/chat_template.py's."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import bad_request
from services.gateway.fields import get_bool, get_dict
from services.gateway.grammar_fields import GRAMMAR_FIELDS
from services.gateway.tool_grammar import tool_call_ebnf

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


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


def parse_chat(body: dict, tool_parser: str | None, reasoning_parser: str | None) -> ChatSpec:
    spec = ChatSpec(messages=_messages(body.get("messages")))
    kwargs = get_dict(body, "chat_template_kwargs") or {}
    spec.template_kwargs = dict(kwargs)
    spec.add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    spec.continue_final_message = get_bool(body, "continue_final_message", False)
    if spec.continue_final_message:
        if spec.messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
        spec.add_generation_prompt = False
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
            raise bad_request("documents must be a list of objects", "documents")
        spec.documents = docs
    _tools(body, spec, tool_parser)
    # SGLang's switches: separate_reasoning (off: <think> stays in content), stream_reasoning (off: the
    # reasoning arrives in one piece when it ends). enable_thinking: false means there is none.
    if reasoning_parser and get_bool(body, "separate_reasoning", True) and kwargs.get("enable_thinking") is not False:
        spec.reasoning_parser = reasoning_parser
        spec.stream_reasoning = get_bool(body, "stream_reasoning", True)
    return spec


# ---------------------------------------------------------------- messages
def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, param: str) -> dict:
    if not isinstance(m, dict):
        raise bad_request(f"{param} must be an object", param)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # a dict or list role is unhashable
        raise bad_request(f"{param}.role must be one of {sorted(_ROLES)}", f"{param}.role")
    out: dict[str, Any] = {"role": role}
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        out["tool_calls"] = _history_calls(calls, f"{param}.tool_calls")
    content = m.get("content")
    if content is None and role == "assistant":
        # Templates concatenate content; a call-only turn keeps it absent, as transformers does.
        out["content"] = None if calls else ""
    else:
        out["content"] = _text(content, f"{param}.content")
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
            out[key] = m[key]
    return out


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def _history_calls(calls: Any, param: str) -> list[dict]:
    """Earlier calls, with their JSON-text arguments as objects: templates write them with tojson."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list", param)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{param}[{i}] must have function.name", f"{param}[{i}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"{param}[{i}].function.arguments is not valid JSON",
                                  f"{param}[{i}].function.arguments") from None
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


# ---------------------------------------------------------------- tools
def _tools(body: dict, spec: ChatSpec, parser: str | None) -> None:
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is deprecated and not supported; use 'tools' and 'tool_choice'", legacy)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return  # as SGLang: the template is not shown tools the model may not call
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise bad_request("tool_choice must name one of the given functions: "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        constrained = [f for f in functions if f["name"] == name]
    elif choice == "required":
        constrained = functions
    elif choice == "auto":
        constrained = []
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    if parser is None:
        raise bad_request("this server cannot parse tool calls for its model: start the gateway with "
                          "--tool-call-parser (hermes or llama3)", "tools")
    spec.tools = [{"type": "function", "function": f} for f in functions]
    spec.tool_parser, spec.tool_names = parser, set(names)
    if constrained:
        clash = next((k for k in GRAMMAR_FIELDS if body.get(k) is not None), None)
        if clash:
            raise bad_request(f"'{clash}' cannot be combined with tool_choice '{choice if isinstance(choice, str) else 'function'}'",
                              "tool_choice")
        parallel = get_bool(body, "parallel_tool_calls", True) and not isinstance(choice, dict)
        try:
            spec.tool_ebnf = tool_call_ebnf(parser, constrained, parallel=parallel)
        except Exception as e:  # xgrammar reports a schema it cannot use as RuntimeError
            raise bad_request(f"a function's parameters schema cannot be used: {str(e).strip()[:300]}",
                              "tools") from None


def _function(tool: Any, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise bad_request(f"{param}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                          f"{param}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
    return {k: v for k, v in fn.items() if v is not None}
