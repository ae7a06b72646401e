"""A request body read and decoded into its route's model (api/models.py) in one msgspec call, every
failure an OpenAI-style 4xx: 413 above the size cap, 408 for a body that stalls, 400 for a body that does not read (bad
Content-Encoding, broken chunks), malformed JSON (NaN included), nesting past the depth cap, half a UTF-16
surrogate pair (`invalid_unicode`), and a value of the wrong type or out of its bounds (its field path in
`param`)."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.gateway.http.errors import APIError, bad_request
from services.gateway.limits import Limits

T = TypeVar("T")

_DECODERS: dict[type, msgspec.json.Decoder] = {}


async def read_body(request: web.Request, limits: Limits, model: type[T]) -> T:
    raw = await _read(request, limits)
    if not raw:
        raise bad_request("request body is empty; a JSON object is expected")
    # Counting brackets runs at C speed; only a body that could be too deep is parsed to measure it.
    if raw.count(b"[") + raw.count(b"{") > limits.max_json_depth and _too_deep(raw, limits.max_json_depth):
        raise bad_request(f"JSON nested deeper than {limits.max_json_depth} levels")
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = _DECODERS[model] = msgspec.json.Decoder(model)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise invalid(e) from None
    except msgspec.DecodeError as e:
        raise _undecodable(raw, e) from None


async def _read(request: web.Request, limits: Limits) -> bytes:
    try:
        async with asyncio.timeout(limits.body_read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_read_timeout_s:g}s",
                       code="request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body exceeds {limits.max_body_bytes} bytes",
                       code="request_too_large") from None
    except (RequestPayloadError, HttpProcessingError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, HttpProcessingError) else e
        message = getattr(cause, "message", "") or str(cause)
        raise bad_request(f"the request body could not be read: {message}", code="invalid_body") from None


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
# Lists whose items are named by index in `param` ("messages[0].role"); inside any other list the field
# itself is named ("prompt", not "prompt[3]"), as the checks this replaced did.
_INDEXED = {"messages", "tools", "tool_calls", "nodes", "branches", "then", "else", "parts"}


def invalid(e: msgspec.ValidationError) -> APIError:
    """The 400 of a body that does not fit its model, `param` the offending field's path."""
    text, path = _AT.match(str(e)).groups()
    param = _param(path or "")
    if m := _UNKNOWN.search(text):
        param = f"{param}.{m.group(1)}" if param else m.group(1)
    elif not param and (m := _MISSING.search(text)):
        return bad_request(text, m.group(1))  # a required top-level field names itself
    return bad_request(f"{param}: {text}" if param else text, param or None)


def _param(path: str) -> str:
    out: list[str] = []
    for name, index in re.findall(r"\.([^.\[]+)|\[([^\]]*)\]", path):
        if name:
            out.append(name)
        elif index.isdigit() and out and out[-1].split("[")[0] in _INDEXED:
            out[-1] += f"[{index}]"
        else:
            break  # an item of a list of values, or a key of a free-form object: the field is named
    return ".".join(out)


def _undecodable(raw: bytes, e: msgspec.DecodeError) -> APIError:
    """Malformed JSON, or JSON with half a surrogate pair ("\\ud800"), which has no UTF-8 form."""
    if b"\\" in raw and _SURROGATE_ESCAPE.search(raw):
        try:
            where = _lone_surrogate(json.loads(raw))
        except ValueError:
            where = None
        if where is not None:
            return bad_request(f"{where or 'the body'} contains a lone UTF-16 surrogate (not valid Unicode text)",
                               where or None, code="invalid_unicode")
    return bad_request(f"malformed JSON: {e}")


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")
_LONE = re.compile("[\ud800-\udfff]")  # json.loads pairs a valid pair into one character: any left is lone


def _lone_surrogate(obj: Any) -> str | None:
    """The path ("messages[0].content") of the first string (key or value) that is not valid Unicode
    text, or None."""
    stack = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _LONE.search(node):
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                if _LONE.search(k):
                    return path or "a key"
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _too_deep(raw: bytes, limit: int) -> bool:
    """Nesting past `limit`, from the brackets outside strings (no parse, so no recursion to exploit)."""
    depth = 0
    for byte in _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False
