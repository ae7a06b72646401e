"""Checks every request passes before it reaches a worker, and the GenerateRequest they produce.
Shared by the OpenAI and native translators so both refuse the same things the same way."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from services.gateway.http.errors import APIError, bad_request
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.gateway.api.models import _OpenAIBody
    from services.gateway.state import GatewayState


def check_model(state: "GatewayState", model: str | None) -> None:
    if model is None:
        return
    if model not in state.model_names():
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{state.served_model_name}'", param="model", code="model_not_found")


# vLLM's extras that name features this server does not have: a 400 that says so, never silently ignored.
_UNSUPPORTED = {
    "use_beam_search": "beam search is not supported",
    "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; /v1/completions with echo and logprobs returns the "
                       "prompt's logprobs",
    "logits_processors": "logits_processors is not supported",
}


def check_openai(state: "GatewayState", body: "_OpenAIBody") -> None:
    """What the OpenAI routes refuse beyond their types: another model, a feature we lack, too many
    choices, best_of other than n, include_stop_str_in_output disagreeing with no_stop_trim."""
    check_model(state, body.model)
    for key, why in _UNSUPPORTED.items():
        if getattr(body, key) not in (None, False, [], {}):
            raise bad_request(why, key, code="unsupported_parameter")
    if not 1 <= body.n <= state.limits.max_n:
        raise bad_request(f"'n' must be in [1, {state.limits.max_n}], got {body.n}", "n")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of different from n is not supported", "best_of")
    keep = body.include_stop_str_in_output
    if keep is not None and body.no_stop_trim is not None and keep != body.no_stop_trim:
        raise bad_request("include_stop_str_in_output and no_stop_trim disagree", "include_stop_str_in_output")
    k = body.truncate_prompt_tokens
    if k is not None and not (k >= 1 or k == -1):
        raise bad_request("truncate_prompt_tokens must be an integer >= 1, or -1 (the context length)",
                          "truncate_prompt_tokens")


def token_ids_in_vocab(state: "GatewayState", ids: Any) -> bool:
    """A list of ints (bools are not) in [0, vocab): one pass in C (min and max were two, ~12 us for 512
    ids)."""
    try:
        msgspec.convert(ids, _ids_below(state.tokenizer.vocab_size))
    except msgspec.ValidationError:
        return False
    return True


def check_token_ids(state: "GatewayState", ids: list[int], param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty", param)
    if token_ids_in_vocab(state, ids):
        return
    vocab = state.tokenizer.vocab_size  # the offender is looked for only if there is one
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)


@functools.lru_cache(maxsize=8)
def _ids_below(vocab: int) -> Any:
    """The type msgspec checks a prompt's ids against: ints in [0, vocab)."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab)]]


async def encode_prompt(state: "GatewayState", text: str, param: str) -> list[int]:
    """A text prompt's token ids, computed off the event loop when large."""
    check_chars_fit(state, len(text), param)
    return await state.cpu.encode(text)


def check_chars_fit(state: "GatewayState", chars: int, param: str) -> None:
    """Refuses, before any tokenizing, a text too long to fit the context whatever it tokenizes to."""
    if state.cpu.chars_cannot_fit(chars, state.context_length):
        raise APIError.from_invalid(ContextLengthExceeded(
            f"This model's maximum context length is {state.context_length} tokens, too few for the {chars} "
            f"characters of '{param}' (context_length_exceeded)", param=param))


def resolve_max_new_tokens(state: "GatewayState", prompt_len: int, requested: int | None,
                           prompt_param: str, max_param: str) -> int:
    """The output budget, refusing prompts that do not fit: clients match on context_length_exceeded."""
    ctx = state.context_length
    if ctx is not None and prompt_len >= ctx:
        raise APIError.from_invalid(ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens "
            f"(context_length_exceeded)", param=prompt_param))
    if requested is None:
        return ctx - prompt_len if ctx is not None else state.limits.default_native_max_new_tokens
    if ctx is not None and prompt_len + requested > ctx:
        raise APIError.from_invalid(ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens; the prompt ({prompt_len} tokens) plus "
            f"the requested {requested} output tokens exceed it (context_length_exceeded)", param=max_param))
    return requested


def sampling_params(state: "GatewayState", d: dict[str, Any]) -> SamplingParams:
    """Validated sampling parameters; token ids they name must exist (a worker indexes logits by them)."""
    try:
        params = SamplingParams.from_dict({k: v for k, v in d.items() if v is not None})
    except InvalidRequest as e:
        raise APIError.from_invalid(e) from None
    vocab = state.tokenizer.vocab_size
    for name, ids in (("logit_bias", params.logit_bias.keys()), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"{name} names a token id outside the vocabulary [0, {vocab})", name)
    return params


_KNOWN_SAMPLING_KEYS = set(SamplingParams.__struct_fields__) | {"sampling_seed"}


def unknown_sampling_keys(state: "GatewayState", d: dict[str, Any]) -> set[str]:
    """Keys of a native `sampling_params` we do not implement: ignored (the caller says so in a Warning
    header), or a 400 naming the first under the gateway's --strict."""
    unknown = {k for k in d if k not in _KNOWN_SAMPLING_KEYS}
    if unknown and state.limits.strict_sampling_params:
        first = sorted(unknown)[0]
        raise bad_request(f"unknown sampling parameter '{first}' (the gateway runs with --strict)", first,
                          code="unknown_parameter")
    return unknown


def stamp_tenant(reqs: list[GenerateRequest], salt: str | None) -> None:
    """Requests of one tenant share cache entries only with each other (the worker keys its radix tree
    by the salt; the router hashes it into prefix affinity)."""
    for r in reqs:
        r.cache_salt = salt


async def check_grammars(state: "GatewayState", reqs: list[GenerateRequest], param: str | None = None) -> None:
    """Compile every distinct grammar off the event loop, with a timeout: an invalid or pathological
    regex/schema is a 400 here and never reaches a worker. Compiled grammars are cached, so a repeated
    schema costs nothing."""
    seen = set()
    for req in reqs:
        grammar = req.sampling.grammar
        if grammar is None or grammar in seen:
            continue
        seen.add(grammar)
        try:
            await state.grammars.compile_async(grammar[0], grammar[1], timeout_s=state.limits.grammar_timeout_s,
                                               param=param or grammar[0])
        except InvalidRequest as e:
            raise APIError.from_invalid(e) from None


def child_requests(rid: str, n: int, input_ids: list[int], params: SamplingParams,
                   **logprob_args: Any) -> list[GenerateRequest]:
    """The n worker requests of one prompt: rid itself when n == 1, `rid-0..n-1` otherwise. A seeded
    request gives each child its own seed (seed + j), so choices differ yet stay reproducible. The children
    share the caller's `input_ids` list (nothing changes a prompt's ids once they are checked): a copy per
    request was a 512-id list more for every young garbage collection to walk while the stream runs."""
    rids = [rid] if n == 1 else [f"{rid}-{j}" for j in range(n)]
    reqs = []
    for j, child in enumerate(rids):
        seed = None if params.seed is None else (params.seed + j) & 0x7FFFFFFF
        sampling = msgspec.structs.replace(params, n=1, seed=seed)
        reqs.append(GenerateRequest(rid=child, input_ids=input_ids, sampling=sampling, **logprob_args))
    return reqs
