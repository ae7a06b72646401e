"""`/tokenize` and `/detokenize` (also under `/v1/`) in both SGLang's and vLLM's shapes (docs/api.md), no
worker involved. Messages render exactly as /v1/chat/completions renders them, so `count` equals that
route's usage.prompt_tokens; `add_special_tokens` defaults to true for a prompt, false for messages."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.gateway.api.admission import check_model, check_token_ids
from services.gateway.api.models import DetokenizeRequest, TokenizeRequest
from services.gateway.api.chat_request import parse_chat
from services.gateway.http.errors import bad_request
from services.gateway.http.body import read_body
from services.gateway.http.json_out import json_response
from services.gateway.api.openai import render_chat

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

# Decoding this many ids or fewer stays on the event loop (well under a millisecond).
INLINE_DECODE_TOKENS = 16 * 1024


async def tokenize(state: "GatewayState", request: web.Request) -> web.Response:
    body = await read_body(request, state.limits, TokenizeRequest)
    check_model(state, body.model)
    prompt, messages = body.prompt, body.messages
    if (prompt is None) == (messages is None):
        raise bad_request("exactly one of 'prompt' and 'messages' is required", "prompt")
    token_strs = body.return_token_strs
    if messages is not None:
        # Off the event loop, as the chat route: tool_choice required / named builds a grammar.
        spec = await asyncio.to_thread(parse_chat, body, state.tool_parser, None)
        rendered = await render_chat(state, spec)
        ids = rendered.ids
        if body.add_special_tokens:
            ids = await state.cpu.encode(rendered.text, add_special_tokens=True)
        return json_response(_tokens_answer(state, ids, token_strs))
    add_special = body.add_special_tokens is not False
    if isinstance(prompt, str):
        return json_response(_tokens_answer(state, await state.cpu.encode(prompt, add_special), token_strs))
    answers = [_tokens_answer(state, await state.cpu.encode(p, add_special), token_strs) for p in prompt]
    return json_response({k: answers[0][k] if k == "max_model_len" else [a[k] for a in answers] for k in answers[0]})


async def detokenize(state: "GatewayState", request: web.Request) -> web.Response:
    body = await read_body(request, state.limits, DetokenizeRequest)
    check_model(state, body.model)
    tokens = body.tokens
    if all(type(t) is int for t in tokens):
        batch = [tokens]
    elif tokens and all(isinstance(t, list) for t in tokens):
        batch = tokens
    else:
        raise bad_request("'tokens' must be a list of token ids or a non-empty list of such lists", "tokens")
    skip = body.skip_special_tokens
    for ids in batch:
        if ids:  # an empty list is the empty text here, not an empty prompt
            check_token_ids(state, ids, "tokens")
    def decode_all() -> list[str]:
        return [state.tokenizer.decode(ids, skip_special_tokens=skip) for ids in batch]
    texts = decode_all() if sum(map(len, batch)) <= INLINE_DECODE_TOKENS else await asyncio.to_thread(decode_all)
    text: str | list[str] = texts if batch is tokens else texts[0]
    return json_response({"text": text, "prompt": text})


def _tokens_answer(state: "GatewayState", ids: list[int], token_strs: bool) -> dict:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.context_length, "tokens": ids}
    if token_strs:
        out["token_strs"] = [state.tokenizer.id_to_token(t) for t in ids]
    return out
