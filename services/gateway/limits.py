"""Caps on what one request may ask for, and the JSON body reader that enforces the structural ones."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.gateway.errors import APIError, bad_request
from shared import limits as shared_limits


@dataclass
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    max_n: int = shared_limits.MAX_N
    max_batch: int = 256
    max_top_logprobs: int = shared_limits.MAX_TOP_LOGPROBS  # the worker enforces the same numbers
    max_rid_len: int = shared_limits.MAX_RID_LEN
    grammar_timeout_s: float = 5.0  # regex / JSON schema compile time allowed before a 400
    # None: a request without max_tokens may fill the remaining context (OpenAI chat semantics).
    default_chat_max_tokens: int | None = None
    default_completion_max_tokens: int = 16  # OpenAI's documented default for /v1/completions
    default_native_max_new_tokens: int = 128  # SGLang's default for /generate
    # --strict: unknown sampling parameters are a 400 instead of a Warning header.
    strict_sampling_params: bool = False


async def read_json(request: web.Request, limits: Limits) -> Any:
    """The request body as JSON, or an APIError: 413 above the size cap, 400 for bad or too deep JSON."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body exceeds {limits.max_body_bytes} bytes",
                       code="request_too_large") from None
    except (RequestPayloadError, HttpProcessingError) as e:
        # A body aiohttp could not read as sent: a Content-Encoding it cannot decode, a broken chunk.
        cause = e.__cause__ if isinstance(e.__cause__, HttpProcessingError) else e
        message = getattr(cause, "message", "") or str(cause)
        raise bad_request(f"the request body could not be read: {message}", code="invalid_body") from None
    if not raw:
        raise bad_request("request body is empty; a JSON object is expected")
    folded = raw.translate(_FOLD)  # one pass for two scans: long runs of digits, and brackets
    try:
        body = _loads(raw, folded)
    except RecursionError:
        raise _too_deep(limits) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON: {e}") from None
    # Counting brackets ("{" folded into "[") runs at C speed; only bodies that could be too deep are walked.
    if folded.count(b"[") > limits.max_json_depth and _depth(body) > limits.max_json_depth:
        raise _too_deep(limits)
    # JSON may escape half a UTF-16 pair ("\ud800"); such a string has no UTF-8 form, so it would fail
    # deep inside (tokenizer, msgpack). Only bodies with a surrogate escape are walked (and only bodies
    # with a backslash searched for one).
    if b"\\" in raw and _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body)
        if where is not None:
            raise bad_request(f"{where or 'the body'} contains a lone UTF-16 surrogate (not valid Unicode text)",
                              where or None, code="invalid_unicode")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


# 19 digits in a row: possibly an integer beyond 64 bits, which orjson would read as a float. Looked for
# as a run of zeros once every digit is made a zero: a regex scan took 17 us of a 512-token prompt's body.
# The same pass folds "{" into "[", so that one count gives the brackets of both kinds.
_FOLD = bytes.maketrans(b"123456789{", b"000000000[")
_LONG_DIGITS = b"0" * 19


def _loads(raw: bytes, folded: bytes | None = None) -> Any:
    """orjson for the bodies it reads exactly as the standard library does (every ordinary one, several
    times faster); a body with a possible integer beyond 64 bits, or one orjson refuses (NaN, lone
    surrogate escapes, nesting past its limit, invalid JSON), goes to the standard library, so the
    result, or the error, is the standard library's either way. `folded`: raw.translate(_FOLD), when the
    caller has it."""
    if _LONG_DIGITS in (raw.translate(_FOLD) if folded is None else folded):
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _lone_surrogate(obj: Any) -> str | None:
    """The path ("messages[0].content") of the first string (key or value) that is not valid Unicode
    text, or None."""
    stack = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _is_text(node):
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else str(k)
                if not _is_text(k):
                    return path or "a key"
                stack.append((v, sub))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(limits: Limits) -> APIError:
    return bad_request(f"JSON nested deeper than {limits.max_json_depth} levels")


def _depth(obj: Any) -> int:
    """Nesting depth, iteratively: a recursive walk is what an attacker's deep body would exploit."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
