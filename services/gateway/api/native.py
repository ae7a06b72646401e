"""SGLang-native `/generate`: `text` | `input_ids`, single or batch, `sampling_params` dict or list,
streaming with cumulative text, logprob entries [logprob, token_id, text-or-null]."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from services.gateway.http.tenancy import request_salt
from services.gateway.api import logprobs as lp
from services.gateway.api.admission import (check_grammars, check_token_ids, child_requests, encode_prompt,
                                       resolve_max_new_tokens, sampling_params, stamp_tenant,
                                       token_ids_in_vocab, unknown_sampling_keys)
from services.gateway.routing.dispatch import GenerationResult
from services.gateway.api.models import GenerateRequest as GenerateBody, NativeChoices
from services.gateway.http.errors import bad_request
from services.gateway.http.body import invalid, read_body
from services.gateway.http.json_out import json_response
from services.gateway.api.sse import encode_event, stream_generation
from shared.ids import unique_hex
from shared.protocol import GenerateRequest, TokenOutput

if TYPE_CHECKING:
    from services.gateway.state import GatewayState


@dataclass
class NativeJob:
    reqs: list[GenerateRequest]
    batched: bool  # answer a list (batch input or n > 1) rather than one object
    with_text: bool  # return_text_in_logprobs
    unknown: list[str] = field(default_factory=list)  # sampling_params keys we do not know (ignored)

    def headers(self) -> dict[str, str]:
        """Ignored keys in a Warning header: escaped to printable ASCII (a header must not split or fail to
        encode), each cut to 64 characters, at most 16 of them."""
        if not self.unknown:
            return {}
        names = [json.dumps(k[:64])[1:-1] for k in self.unknown[:16]]
        more = f" and {len(self.unknown) - 16} more" if len(self.unknown) > 16 else ""
        return {"Warning": f'299 radixserve "unknown sampling parameters ignored: {", ".join(names)}{more}"'}


async def generate(state: "GatewayState", request: web.Request) -> web.StreamResponse:
    body = await read_body(request, state.limits, GenerateBody)
    job = await _build(state, body)
    stamp_tenant(job.reqs, request_salt(request))
    state.dispatcher.check_rids([r.rid for r in job.reqs], request_salt(request))  # before any header goes out
    await check_grammars(state, job.reqs)
    if body.stream:
        return await stream_generation(request, state.dispatcher, job.reqs, _NativeFormat(state, job),
                                       headers=job.headers())
    return json_response(await _run(state, job), headers=job.headers())


async def generate_json(state: "GatewayState", body: dict, admit=None, cache_salt: str | None = None) -> dict | list:
    """`/generate` in process, without streaming: what the server-side program executor calls.
    `admit(requests)`, once the prompts are tokenized and before anything is sent, may refuse them."""
    try:
        typed = msgspec.convert(body, GenerateBody)
    except msgspec.ValidationError as e:
        raise invalid(e) from None
    job = await _build(state, typed)
    if admit is not None:
        admit(job.reqs)
    stamp_tenant(job.reqs, cache_salt)
    state.dispatcher.check_rids([r.rid for r in job.reqs], cache_salt)
    await check_grammars(state, job.reqs)
    return await _run(state, job)


async def _run(state: "GatewayState", job: NativeJob) -> dict | list:
    results = await state.dispatcher.collect_many(job.reqs)
    answers = [_answer(state, job, req, res) for req, res in zip(job.reqs, results)]
    return answers if job.batched else answers[0]


async def _build(state: "GatewayState", body: GenerateBody) -> NativeJob:
    text, input_ids = body.text, body.input_ids
    if (text is None) == (input_ids is None):
        raise bad_request("exactly one of 'text' and 'input_ids' is required", "text")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]  # non-empty (models.py)
        if len(texts) > state.limits.max_batch:
            raise bad_request(f"at most {state.limits.max_batch} prompts per request", "text")
        prompts = [await encode_prompt(state, t, "text") for t in texts]
    else:
        batched = bool(input_ids) and all(isinstance(x, list) for x in input_ids)
        prompts = input_ids if batched else [input_ids]
        # The common case in one check a prompt; any other shape or error below.
        if not all(p and token_ids_in_vocab(state, p) for p in prompts):
            if not batched and not all(type(t) is int for t in input_ids):
                raise bad_request("'input_ids' must be a list of token ids or a list of such lists", "input_ids")
            for p in prompts:
                check_token_ids(state, p, "input_ids")
    count = len(prompts)
    if count > state.limits.max_batch:
        raise bad_request(f"at most {state.limits.max_batch} prompts per request", "text")

    sps, rids, return_logprob, start_lens, top_nums = (
        _per_item(getattr(body, name), name, count)
        for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"))

    reqs: list[GenerateRequest] = []
    unknown: set[str] = set()
    any_n = False
    for i, ids in enumerate(prompts):
        raw = dict(sps[i] or {})
        unknown |= unknown_sampling_keys(state, raw)
        try:
            choices = msgspec.convert(raw, NativeChoices)
        except msgspec.ValidationError as e:
            raise invalid(e) from None
        if choices.n > state.limits.max_n:
            raise bad_request(f"'n' must be <= {state.limits.max_n}, got {choices.n}", "n")
        any_n |= choices.n > 1
        requested = choices.max_new_tokens
        if requested is None:  # SGLang's default, shortened rather than refused near the context end
            requested = state.limits.default_native_max_new_tokens
            if state.context_length is not None:
                requested = max(0, min(requested, state.context_length - len(ids)))
        raw["max_new_tokens"] = resolve_max_new_tokens(state, len(ids), requested, "input_ids", "max_new_tokens")
        params = sampling_params(state, raw)
        start = start_lens[i] if start_lens[i] is not None else -1
        if start >= len(ids):
            start = len(ids) - 1  # select() may ask from past a short prompt's end: keep the last position
        reqs += child_requests(rids[i] or unique_hex(), choices.n, ids, params,
                               return_logprob=bool(return_logprob[i]), logprob_start_len=start,
                               top_logprobs_num=top_nums[i] or 0,
                               return_text_in_logprobs=body.return_text_in_logprobs)
    if len(reqs) > state.limits.max_batch:
        raise bad_request(f"at most {state.limits.max_batch} generations per request (prompts x n)", "n")
    return NativeJob(reqs, batched or any_n, body.return_text_in_logprobs, sorted(unknown))


def _per_item(value: Any, name: str, count: int) -> list:
    """A field given once for all inputs, or as a list of one value per input."""
    if value is None:
        return [None] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise bad_request(f"'{name}' has {len(value)} entries for {count} inputs", name)
    return value


def _answer(state: "GatewayState", job: NativeJob, req: GenerateRequest, res: GenerationResult) -> dict:
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": None if res.finish_reason is None else res.finish_reason.to_json(),
        "prompt_tokens": res.prompt_tokens or len(req.input_ids),
        "completion_tokens": res.completion_tokens, "cached_tokens": res.cached_tokens,
        "e2e_latency": res.e2e_latency,
    }
    if res.spec_verify_ct:  # speculative decoding on the worker (SGLang's key)
        meta["spec_verify_ct"] = res.spec_verify_ct
    if req.return_logprob:
        tok, text = state.tokenizer, job.with_text
        input_lps = _with_first_null(req, res.input_logprobs)
        meta.update(
            input_token_logprobs=lp.native_entries(input_lps, tok, text),
            output_token_logprobs=lp.native_entries(res.output_logprobs, tok, text),
            input_top_logprobs=lp.native_tops(res.input_top_logprobs, tok, text),
            output_top_logprobs=lp.native_tops(res.output_top_logprobs, tok, text),
        )
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}  # encoded before it changes


def _with_first_null(req: GenerateRequest, entries: list) -> list:
    """Position 0 has no logprob (nothing precedes it); if the worker left it out, put the null back so
    entries line up with input positions."""
    if req.logprob_start_len == 0 and len(entries) == len(req.input_ids) - 1:
        return [[None, req.input_ids[0]]] + list(entries)
    return entries


class _NativeFormat:
    """Stream events of /generate (an EventFormat): each carries the request's output so far (cumulative:
    SGLang's frontend slices off what it has seen)."""

    __slots__ = ("state", "job")

    def __init__(self, state: "GatewayState", job: NativeJob):
        self.state, self.job = state, job

    def head(self) -> bytes:
        return b""

    tail = head

    def on_output(self, i: int, out: TokenOutput, res: GenerationResult) -> bytes:
        event = _answer(self.state, self.job, self.job.reqs[i], res)
        if self.job.batched:
            event["index"] = i
        return encode_event(event)
