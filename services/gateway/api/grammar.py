"""The one output grammar an OpenAI-route body names, as the sampling fields the worker compiles
(`json_schema`, `regex`, `ebnf`), and the field that named it (for errors). Two are a 400, never one
silently dropped. Sources: OpenAI's `response_format`; vLLM's `structured_outputs` and its pre-0.12
`guided_*` fields (a `choice` list becomes `root ::= "a" | "b"`); SGLang's own `regex`, `json_schema`,
`ebnf` extras, which travel as sampling fields already and are only counted here.
"""
from __future__ import annotations

import json
from typing import Any

from services.gateway.api.models import ResponseFormat, StructuredOutputs, _OpenAIBody
from services.gateway.http.errors import bad_request

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SGLANG = ("regex", "json_schema", "ebnf")
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_ANY_OBJECT = json.dumps({"type": "object"})

# Every top-level field that can name the output's grammar (tool_choice required / named excludes them).
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *_LEGACY, *_SGLANG)


def output_grammar(body: _OpenAIBody) -> tuple[dict[str, str], str | None]:
    sources: list[tuple[str, dict[str, str]]] = []
    if body.response_format is not None and (fmt := _response_format(body.response_format)):
        sources.append(("response_format", fmt))
    if body.structured_outputs is not None and (got := _structured_outputs(body.structured_outputs)):
        sources.append(got)
    for legacy, kind in _LEGACY.items():
        if (value := getattr(body, legacy)) is not None:
            sources.append((legacy, _constraint(kind, value)))
    if body.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    sources += [(k, {}) for k in _SGLANG if getattr(body, k) is not None]
    if len(sources) > 1:
        raise bad_request(f"'{sources[0][0]}' and '{sources[1][0]}' both constrain the output; give one",
                          sources[1][0])
    return (sources[0][1], sources[0][0]) if sources else ({}, None)


def _response_format(fmt: ResponseFormat) -> dict[str, str]:
    if fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_schema": _ANY_OBJECT}
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema must be an object with a 'name'",
                          "response_format.json_schema")
    return {"json_schema": json.dumps(fmt.json_schema.schema)}


def _structured_outputs(so: StructuredOutputs) -> tuple[str, dict[str, str]] | None:
    given = [k for k in _CONSTRAINTS if getattr(so, k) not in (None, False) or (k == "json" and so.json is False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one constraint, got {' and '.join(given)}",
                          f"structured_outputs.{given[1]}")
    if not given:
        return None
    return f"structured_outputs.{given[0]}", _constraint(given[0], getattr(so, given[0]))


def _constraint(kind: str, value: Any) -> dict[str, str]:
    if kind == "json":
        # JSON text is passed as given: the compiler refuses text that is not a schema (400).
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    if kind == "json_object":
        return {"json_schema": _ANY_OBJECT}
    if kind == "choice":  # choices, regexes and grammars are non-empty (models.py)
        return {"ebnf": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
    return {"regex": value} if kind == "regex" else {"ebnf": value}
