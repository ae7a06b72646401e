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
    text = str(one)
    if not parallel:
        return text
    # One or more calls: the single-call grammar becomes rule `tool_call_one` under a repeating root.
    return f"root ::= tool_call_one ({json.dumps(sep)} tool_call_one)*\n" + _rename_rule(text, "root", "tool_call_one")


def _rename_rule(ebnf: str, old: str, new: str) -> str:
    """Rename rule `old` wherever it is defined or referenced, leaving string literals and character
    classes (which may contain the same word) untouched."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (ebnf[j].isalnum() or ebnf[j] in "_-."):
                j += 1
            word = ebnf[i:j]
            out.append(new if word == old else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
