"""The grammar that makes `tool_choice: required` (or a named function) come out as parseable calls, in the
model's own format (hermes `<tool_call>` blocks, llama3 `; `-separated objects): each call's `name` is a
constant and its arguments follow the function's `parameters` schema. EBNF text for the request's `ebnf`
sampling field, validated and compiled like any grammar."""
from __future__ import annotations

import json

import xgrammar as xgr

from shared.constrained.schema_fixes import harden_json_schema

# parser -> (text before a call, the key arguments go under, text after a call, separator between calls)
FORMATS = {
    "hermes": ("<tool_call>\n", "arguments", "\n</tool_call>", "\n"),
    "llama3": ("", "parameters", "", "; "),
}


def call_schema(name: str, parameters: dict | None, args_key: str) -> dict:
    params = harden_json_schema(parameters) if parameters else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def tool_call_ebnf(parser: str, functions: list[dict], parallel: bool = True) -> str:
    """EBNF for one call (or, when `parallel`, one or more) of any of `functions` (OpenAI function
    objects: name, parameters)."""
    before, args_key, after, sep = FORMATS[parser]
    alternatives = [xgr.Grammar.from_json_schema(json.dumps(call_schema(f["name"], f.get("parameters"), args_key)),
                                                 any_whitespace=False) for f in functions]
    body = alternatives[0] if len(alternatives) == 1 else xgr.Grammar.union(*alternatives)
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(before)}")] if before else []
    parts.append(body)
    if after:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}"))
    one = parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
    if not parallel:
        return str(one)
    # One or more calls: the single call becomes rule `tool_call_one` under a repeating root. Grammar.concat
    # renames its part's rules (root_1, ...), so its own root, defined first, is referenced nowhere.
    single = str(xgr.Grammar.concat(one))
    assert single.startswith("root ::= "), single[:80]
    return (f"root ::= tool_call_one ({json.dumps(sep)} tool_call_one)*\n"
            + single.replace("root ::= ", "tool_call_one ::= ", 1))
