"""JSON out of the gateway, encoded once with orjson: every SSE event (one per token per stream) and every
response body. Anything orjson refuses (an int beyond 64 bits, a non-string key) falls back to the
standard library, so the output is the same JSON either way, UTF-8 without ASCII escaping."""
from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

_OPTS = orjson.OPT_NON_STR_KEYS


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj, option=_OPTS)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, headers=headers, content_type="application/json",
                        charset="utf-8")
