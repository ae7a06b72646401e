"""`/tokenize` and `/detokenize` (also under `/v1/`): the served model's tokenizer over HTTP, in the shapes
both SGLang's and vLLM's servers answer, so their clients (prompt builders that count tokens, benchmark
scripts that make exact-length prompts) work unchanged. No worker is involved.

/tokenize takes exactly one of `prompt` (a string, or a list of strings: SGLang's batch form) and
`messages` (rendered by the chat template exactly as /v1/chat/completions renders them, so `count`
equals that route's usage.prompt_tokens). It answers {count, max_model_len, tokens}, plus `token_strs`
(the vocabulary's strings) with `return_token_strs`. `add_special_tokens` defaults to true for a prompt
and to false for messages (the template adds its own), as both servers do.

/detokenize takes `tokens` (ids, or a list of id lists) and answers the text under both servers' names:
`text` (SGLang) and `prompt` (vLLM). Special tokens are skipped unless `skip_special_tokens` is false
(SGLang's default; vLLM keeps them, so a vLLM client that wants them back passes false).
"""
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
        if not messages:
            raise bad_request("messages must be a non-empty list", "messages")
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
    if not prompt:
        raise bad_request("'prompt' must be a string or a non-empty list of strings", "prompt")
    lists = [await state.cpu.encode(p, add_special) for p in prompt]
    out: dict[str, Any] = {"count": [len(ids) for ids in lists], "max_model_len": state.context_length,
                           "tokens": lists}
    if token_strs:
        out["token_strs"] = [_token_strs(state, ids) for ids in lists]
    return json_response(out)


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
    decode = state.tokenizer.decode
    if sum(map(len, batch)) <= INLINE_DECODE_TOKENS:
        texts = [decode(ids, skip_special_tokens=skip) for ids in batch]
    else:
        texts = await asyncio.to_thread(lambda: [decode(ids, skip_special_tokens=skip) for ids in batch])
    text: str | list[str] = texts if batch is tokens else texts[0]
    return json_response({"text": text, "prompt": text})


def _tokens_answer(state: "GatewayState", ids: list[int], token_strs: bool) -> dict:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.context_length, "tokens": ids}
    if token_strs:
        out["token_strs"] = _token_strs(state, ids)
    return out


def _token_strs(state: "GatewayState", ids: list[int]) -> list[str | None]:
    return [state.tokenizer.id_to_token(t) for t in ids]
