"""Schema rewrites that route around known xgrammar 0.2.x JSON-schema bugs before compiling.

xgrammar lowers a string with minLength/maxLength (and no pattern) to a repetition of a class
that only excludes quote, backslash, CR and LF, so it admits raw control characters that JSON
forbids and a bounded string can come out as invalid JSON (mlc-ai/xgrammar#800). Its `pattern` path is JSON-string aware
and excludes them, so we express the length bound as an equivalent pattern. The pattern also
leaves out UTF-16 surrogates: xgrammar's UTF-8 reader accepts their (invalid) 3-byte encodings,
which decode to one U+FFFD per byte and so break the length bound after detokenization.
"""
from __future__ import annotations

from typing import Any

_STRING_CHAR = r'[^\x00-\x1f"\\\ud800-\udfff]'


def harden_json_schema(schema: Any) -> Any:
    """A copy of `schema` with the workarounds applied; unrelated parts are left as they were."""
    if isinstance(schema, list):
        return [harden_json_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: harden_json_schema(v) for k, v in schema.items()}
    if _is_length_bounded_string(out):
        lo = out.pop("minLength", 0)
        hi = out.pop("maxLength", None)
        out["pattern"] = f"^{_STRING_CHAR}{{{lo},{'' if hi is None else hi}}}$"
    return out


def _is_length_bounded_string(s: dict) -> bool:
    if s.get("type") != "string" or any(k in s for k in ("pattern", "format", "enum", "const")):
        return False
    bounds = [s[k] for k in ("minLength", "maxLength") if k in s]
    return bool(bounds) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bounds)
