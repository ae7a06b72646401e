"""Caps on what one request may ask for, and the JSON body reader that enforces the structural ones."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.gateway.errors import APIError, bad_request


@dataclass
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    max_n: int = 16
    max_batch: int = 256
    max_top_logprobs: int = 20
    max_rid_len: int = 128
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
    if not raw:
        raise bad_request("request body is empty; a JSON object is expected")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(limits) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON: {e}") from None
    # Counting brackets runs at C speed; only bodies that could be too deep are walked.
    if raw.count(b"[") + raw.count(b"{") > limits.max_json_depth and _depth(body) > limits.max_json_depth:
        raise _too_deep(limits)
    return body


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
