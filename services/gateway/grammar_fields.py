"""Which fields of an OpenAI-route body name the output's grammar, as the sampling fields the worker
compiles (`json_schema`, `regex`, `ebnf`). A request has at most one; two are a 400, never one silently
dropped.

- OpenAI's `response_format` (`text`, `json_object`, `json_schema`);
- vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`), and the `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar` fields vLLM took before 0.12 (many clients still send
  them; `guided_decoding_backend` is a backend hint, ignored). A `choice` list becomes the grammar
  `root ::= "a" | "b"`. What we cannot honour (`whitespace_pattern`, `structural_tag`) is refused, as is
  an unknown key inside `structured_outputs`: a typo there would otherwise mean unconstrained output;
- SGLang's own `regex`, `json_schema`, `ebnf` extras (carried as sampling fields): only counted here.
"""
from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import bad_request
from services.gateway.fields import get_dict

_SGLANG_KEYS = ("regex", "json_schema", "ebnf")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")  # no effect here
_REFUSED = ("whitespace_pattern", "structural_tag")
_ANY_OBJECT = json.dumps({"type": "object"})


# Every top-level field that can name the output's grammar (tool_choice required / named cannot be combined
# with any of them).
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *_LEGACY, *_SGLANG_KEYS)


def output_grammar(body: dict) -> tuple[dict[str, str], str | None]:
    """The sampling fields of the body's one output grammar and the field that named it, for errors
    ({} when it names none, or names it only through SGLang's extras, which travel as sampling fields
    already)."""
    sources: list[tuple[str, dict[str, str]]] = []
    fmt = response_format(body)
    if fmt:
        sources.append(("response_format", fmt))
    so = get_dict(body, "structured_outputs")
    if so is not None:
        got = _structured_outputs(so)
        if got is not None:
            sources.append(got)
    for legacy, kind in _LEGACY.items():
        if body.get(legacy) is not None:
            sources.append((legacy, _constraint(kind, body[legacy], legacy)))
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    sources += [(k, {}) for k in _SGLANG_KEYS if body.get(k) is not None]
    if len(sources) > 1:
        raise bad_request(f"'{sources[0][0]}' and '{sources[1][0]}' both constrain the output; give one",
                          sources[1][0])
    return (sources[0][1], sources[0][0]) if sources else ({}, None)


def response_format(body: dict) -> dict[str, str]:
    fmt = get_dict(body, "response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": _ANY_OBJECT}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request("response_format.json_schema must be an object with a 'name'",
                              "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        return {"json_schema": json.dumps(schema)}
    raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema'",
                      "response_format.type")


def _structured_outputs(so: dict) -> tuple[str, dict[str, str]] | None:
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _REFUSED:
            if value is not None:
                raise bad_request(f"{param} is not supported", param)
        elif key in _OPTIONS:
            if value is not None and not isinstance(value, bool):
                raise bad_request(f"{param} must be a boolean", param)
        elif key not in _CONSTRAINTS:
            raise bad_request(f"unknown field {param}; supported: {', '.join(_CONSTRAINTS)}", param)
    given = [k for k in _CONSTRAINTS if so.get(k) is not None and not (k == "json_object" and so[k] is False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one constraint, got {' and '.join(given)}",
                          f"structured_outputs.{given[1]}")
    if not given:
        return None
    param = f"structured_outputs.{given[0]}"
    return param, _constraint(given[0], so[given[0]], param)


def _constraint(kind: str, value: Any, param: str) -> dict[str, str]:
    if kind == "json":
        if isinstance(value, (dict, bool)):
            return {"json_schema": json.dumps(value)}
        if isinstance(value, str):
            return {"json_schema": value}  # the compiler refuses text that is not a schema (400)
        raise bad_request(f"{param} must be a JSON schema (an object or its JSON text)", param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{param} must be true", param)
        return {"json_schema": _ANY_OBJECT}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return {"ebnf": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return {"regex": value} if kind == "regex" else {"ebnf": value}
