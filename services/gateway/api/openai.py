"""OpenAI `/v1/completions`, `/v1/chat/completions` and `/v1/models`: translation to GenerateRequests and
back. A request with n choices over P prompts becomes P*n worker requests; choice index = p*n + j."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2
from aiohttp import web

from services.gateway.http.tenancy import request_salt
from services.gateway.api import logprobs as lp
from services.gateway.api.models import ChatRequest, CompletionRequest, _OpenAIBody
from services.gateway.api.chat_output import ChoiceOutput
from services.gateway.api.chat_request import ChatSpec, parse_chat
from services.gateway.api.admission import (check_chars_fit, check_grammars, check_model, check_openai,
                                            check_token_ids, child_requests, encode_prompt, resolve_max_new_tokens,
                                            sampling_params, stamp_tenant, token_ids_in_vocab)
from services.gateway.routing.dispatch import GenerationResult
from services.gateway.http.errors import APIError, bad_request
from services.gateway.api.grammar import output_grammar
from services.gateway.http.body import read_body
from services.gateway.http.json_out import json_response
from services.gateway.api.sse import Envelope, encode_event, stream_generation
from shared.ids import unique_hex
from shared.protocol import FinishReason, GenerateRequest, TokenOutput

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

# OpenAI body fields passed to SamplingParams, under SGLang's names (vLLM/SGLang clients send top_k,
# min_p, ignore_eos... through extra_body).
_SAMPLING_KEYS = {k: k for k in (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "stop", "stop_token_ids", "seed", "logit_bias", "ignore_eos", "skip_special_tokens", "no_stop_trim", "regex",
    "json_schema", "ebnf", "spaces_between_special_tokens")} | {"min_tokens": "min_new_tokens"}
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class Prompt:
    """One prompt's token ids and text. A prompt given as token ids is decoded only if its text is read
    (echo): decoding every 512-token prompt up front was a fifth of the gateway's per-request CPU."""

    __slots__ = ("ids", "_text", "_tokenizer")

    def __init__(self, ids: list[int], text: str | None = None, tokenizer=None):
        self.ids, self._text, self._tokenizer = ids, text, tokenizer

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._tokenizer.decode(self.ids, skip_special_tokens=False)
        return self._text


@dataclass(slots=True)
class Job:
    """One OpenAI request, validated and fanned out."""
    id: str
    prompts: list[Prompt]
    n: int
    reqs: list[GenerateRequest]
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def prompt_of(self, choice: int) -> int:
        return choice // self.n


# ---------------------------------------------------------------- shared translation
def _common(state: "GatewayState", body: _OpenAIBody) -> tuple[int, bool, bool]:
    check_openai(state, body)
    include_usage = body.stream and body.stream_options is not None and body.stream_options.include_usage
    return body.n, body.stream, include_usage


def _fan_out(state: "GatewayState", body: _OpenAIBody, prompts: list[Prompt], n: int, max_tokens: int | None,
             prompt_param: str, max_param: str, rid_prefix: str, extra_sampling: dict | None = None,
             extra_param: str | None = None, **logprob_args: Any) -> tuple[str, list[GenerateRequest]]:
    """`extra_sampling`: sampling fields the route derived from the body (a grammar), named `extra_param`
    in errors about them (the client sent `structured_outputs.regex`, not `regex`)."""
    if len(prompts) * n > state.limits.max_batch:
        raise bad_request(f"at most {state.limits.max_batch} choices per request (prompts x n)", "n")
    job_id = rid_prefix + unique_hex()
    reqs = []
    for p_idx, prompt in enumerate(prompts):
        budget = resolve_max_new_tokens(state, len(prompt.ids), max_tokens, prompt_param, max_param)
        raw = {ours: v for theirs, ours in _SAMPLING_KEYS.items() if (v := getattr(body, theirs)) is not None}
        if body.include_stop_str_in_output is not None:
            raw["no_stop_trim"] = body.include_stop_str_in_output
        raw.update(extra_sampling or {})
        raw["max_new_tokens"] = budget
        try:
            params = sampling_params(state, raw)
        except APIError as e:
            if extra_param and e.param in (extra_sampling or {}):
                e.param = extra_param
            raise
        reqs += child_requests(f"{job_id}-{p_idx}", n, prompt.ids, params, **logprob_args)
    return job_id, reqs


async def _answer(state: "GatewayState", request: web.Request, grammar_param: str | None, stream: bool,
                  fmt: "_Format") -> web.StreamResponse:
    """The job's requests, in the tenant's namespace, grammars checked: an SSE stream or one JSON answer."""
    reqs = fmt.job.reqs
    stamp_tenant(reqs, request_salt(request))
    await check_grammars(state, reqs, param=grammar_param)
    if stream:
        return await stream_generation(request, state.dispatcher, reqs, fmt)
    return json_response(fmt.response(await state.dispatcher.collect_many(reqs)))


def _usage(job: Job, results: dict[int, GenerationResult]) -> dict:
    prompt = cached = 0
    for p_idx, prompt_in in enumerate(job.prompts):
        # The prompt is billed once however many choices share it: take its first choice's counts.
        first = results.get(p_idx * job.n)
        prompt += first.prompt_tokens if first and first.prompt_tokens else len(prompt_in.ids)
        cached += first.cached_tokens if first else 0
    completion = sum(r.completion_tokens for r in results.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH.get(reason.TYPE, "stop")


# ---------------------------------------------------------------- /v1/completions
async def completions(state: "GatewayState", request: web.Request) -> web.StreamResponse:
    body = await read_body(request, state.limits, CompletionRequest)
    n, stream, include_usage = _common(state, body)
    if body.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    prompts = _truncated(state, body, await _parse_prompts(state, body.prompt))
    echo, top_k = body.echo, body.logprobs
    max_tokens = state.limits.default_completion_max_tokens if body.max_tokens is None else body.max_tokens
    want_lp = top_k is not None
    extra, grammar_param = output_grammar(body)
    job_id, reqs = _fan_out(state, body, prompts, n, max_tokens, "prompt", "max_tokens", "cmpl-",
                            extra_sampling=extra, extra_param=grammar_param, return_logprob=want_lp,
                            logprob_start_len=0 if (want_lp and echo) else -1, top_logprobs_num=top_k or 0)
    job = Job(job_id, prompts, n, reqs, include_usage)
    return await _answer(state, request, grammar_param, stream, _CompletionFormat(state, job, echo, want_lp))


async def _parse_prompts(state: "GatewayState", prompt: str | list) -> list[Prompt]:
    tok = state.tokenizer
    if isinstance(prompt, list) and prompt and token_ids_in_vocab(state, prompt):
        return [Prompt(prompt, tokenizer=tok)]  # the common case in one check; any other shape or error below
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(type(p) is int for p in prompt):
        items = [prompt]
    elif prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        items = prompt
    else:
        raise bad_request("prompt must be a non-empty string, list of strings, list of token ids or list of "
                          "token id lists", "prompt")
    if len(items) > state.limits.max_batch:
        raise bad_request(f"at most {state.limits.max_batch} prompts per request", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty", "prompt")
            out.append(Prompt(await encode_prompt(state, item, "prompt"), item))
        else:
            check_token_ids(state, item, "prompt")
            out.append(Prompt(item, tokenizer=tok))  # the body's own list: nothing else holds or changes it
    return out


def _truncated(state: "GatewayState", body: _OpenAIBody, prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt's last tokens where the body asks for vLLM's truncate_prompt_tokens."""
    k = state.context_length if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
    if k is None:
        return prompts
    return [p if len(p.ids) <= k else Prompt(p.ids[-k:], tokenizer=state.tokenizer) for p in prompts]


class _Format:
    """The answer of an OpenAI request: whole (`response`) or as stream chunks (an EventFormat)."""
    OBJECT = CHUNK_OBJECT = ""

    def __init__(self, state: "GatewayState", job: Job, want_lp: bool):
        self.state, self.tok = state, state.tokenizer
        self.job, self.want_lp = job, want_lp
        self._results: dict[int, GenerationResult] = {}  # streaming: each choice's result so far
        self._chunk: Envelope | None = None  # streaming: a chunk's event around its choice

    def _envelope(self, choices: list | None, object: str, **extra) -> dict:
        out = {"id": self.job.id, "object": object, "created": self.job.created, "model": self.state.served_model_name}
        return out if choices is None else {**out, "choices": choices, **extra}

    def head(self) -> bytes:
        """Streaming starts: the chunks' envelope, encoded once."""
        self._chunk = Envelope(self._envelope(None, self.CHUNK_OBJECT),
                               **({"usage": None} if self.job.include_usage else {}))
        return b""

    def tail(self) -> bytes:
        if not self.job.include_usage:
            return b""
        return encode_event(self._envelope([], self.CHUNK_OBJECT, usage=_usage(self.job, self._results)))


class _CompletionFormat(_Format):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def __init__(self, state: "GatewayState", job: Job, echo: bool, want_lp: bool):
        super().__init__(state, job, want_lp)
        self.echo = echo
        self._offsets: dict[int, int] = {}  # streaming, with echo or logprobs: characters sent so far per choice

    def _echo_logprobs(self, prompt: Prompt, res: GenerationResult) -> dict:
        return lp.completion_logprobs(prompt.ids, res.input_logprobs, res.input_top_logprobs, self.tok, 0)

    def response(self, results: list[GenerationResult]) -> dict:
        choices = []
        for i, res in enumerate(results):
            prompt = self.job.prompts[self.job.prompt_of(i)]
            prefix = prompt.text if self.echo else ""
            logprobs = None
            if self.want_lp:
                logprobs = lp.completion_logprobs(res.output_ids, res.output_logprobs, res.output_top_logprobs,
                                                  self.tok, len(prefix))
                if self.echo:
                    logprobs = lp.merge_completion_logprobs(self._echo_logprobs(prompt, res), logprobs)
            choices.append({"index": i, "text": prefix + res.text, "logprobs": logprobs,
                            "finish_reason": _finish(res.finish_reason)})
        return self._envelope(choices, self.OBJECT, usage=_usage(self.job, dict(enumerate(results))))

    def on_output(self, i: int, out: TokenOutput, res: GenerationResult) -> bytes:
        self._results[i] = res
        if self.echo or self.want_lp:
            text, logprobs = self._echoed(i, out, res)
        else:
            text, logprobs = out.text, None
        if not text and not out.finished and not (logprobs and logprobs["tokens"]):
            return b""  # tokens whose text is held back (partial UTF-8, possible stop string)
        return self._chunk.event({"index": i, "text": text, "logprobs": logprobs,
                                  "finish_reason": _finish(out.finish_reason)})

    def _echoed(self, i: int, out: TokenOutput, res: GenerationResult) -> tuple[str, dict | None]:
        """An increment's text and logprobs with echo (the prompt before the first) or logprobs asked for,
        which count the characters sent so far (text_offset)."""
        offsets = self._offsets
        text, logprobs = out.text, None
        if i not in offsets and self.echo:
            prompt = self.job.prompts[self.job.prompt_of(i)]
            text = prompt.text + text
            if self.want_lp:
                logprobs = self._echo_logprobs(prompt, res)
        if self.want_lp:
            start = len(res.output_ids) - len(out.token_ids)
            new = lp.completion_logprobs(out.token_ids, res.output_logprobs[start:],
                                         res.output_top_logprobs[start:], self.tok,
                                         offsets.get(i, 0) + len(text) - len(out.text))
            logprobs = new if logprobs is None else lp.merge_completion_logprobs(logprobs, new)
        offsets[i] = offsets.get(i, 0) + len(text)
        return text, logprobs


# ---------------------------------------------------------------- /v1/chat/completions
async def chat_completions(state: "GatewayState", request: web.Request) -> web.StreamResponse:
    body = await read_body(request, state.limits, ChatRequest)
    n, stream, include_usage = _common(state, body)
    # Off the event loop: tool_choice required / named converts every function's schema to a grammar.
    spec = await asyncio.to_thread(parse_chat, body, state.tool_parser, state.reasoning_parser)
    [prompt] = _truncated(state, body, [await render_chat(state, spec)])
    want_lp, top_k = body.logprobs, body.top_logprobs or 0
    if top_k and not want_lp:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, max_param)
    if max_tokens is None:
        max_tokens = state.limits.default_chat_max_tokens
    extra, grammar_param = ({"ebnf": spec.tool_ebnf}, "tools") if spec.tool_ebnf else output_grammar(body)
    job_id, reqs = _fan_out(state, body, [prompt], n, max_tokens, "messages", max_param, "chatcmpl-",
                            extra_sampling=extra, extra_param=grammar_param, return_logprob=want_lp,
                            top_logprobs_num=top_k)
    job = Job(job_id, [prompt], n, reqs, include_usage)
    return await _answer(state, request, grammar_param, stream, _ChatFormat(state, job, want_lp, spec))


async def render_chat(state: "GatewayState", spec: ChatSpec) -> Prompt:
    """The chat template applied and tokenized: in a pool process when the messages are large."""
    chars = sum(len(m["content"] or "") for m in spec.messages)  # a string or None (chat_request._message)
    check_chars_fit(state, chars, "messages")
    try:
        text, ids = await state.cpu.render_chat(spec.messages, chars, dict(
            add_generation_prompt=spec.add_generation_prompt, tools=spec.tools, documents=spec.documents,
            continue_final_message=spec.continue_final_message, template_kwargs=spec.template_kwargs))
    except (ValueError, jinja2.TemplateError) as e:  # ChatTemplateError is a ValueError
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    check_token_ids(state, ids, "messages")
    return Prompt(ids, text)


class _ChatFormat(_Format):
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def __init__(self, state: "GatewayState", job: Job, want_lp: bool, spec: ChatSpec):
        super().__init__(state, job, want_lp)
        self.spec = spec
        self._outputs: list[ChoiceOutput] | None = None  # streaming: each choice's output parsers

    def _logprobs(self, token_ids, logprobs, tops) -> dict | None:
        return lp.chat_logprobs(token_ids, logprobs, tops, self.tok) if self.want_lp else None

    def _output(self) -> ChoiceOutput:
        return ChoiceOutput(self.spec, self.job.prompts[0].text)

    def response(self, results: list[GenerationResult]) -> dict:
        choices = []
        for i, res in enumerate(results):
            out = self._output()
            choices.append({"index": i, "message": out.message(res.text),
                            "logprobs": self._logprobs(res.output_ids, res.output_logprobs, res.output_top_logprobs),
                            "finish_reason": out.finish_reason(_finish(res.finish_reason))})
        return self._envelope(choices, self.OBJECT, usage=_usage(self.job, dict(enumerate(results))))

    def _delta(self, index: int, delta: dict, logprobs=None, finish=None) -> bytes:
        return self._chunk.event({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def head(self) -> bytes:
        super().head()
        self._outputs = [self._output() for _ in self.job.reqs]
        return b"".join(self._delta(i, {"role": "assistant", "content": ""}) for i in range(len(self.job.reqs)))

    def on_output(self, i: int, out: TokenOutput, res: GenerationResult) -> bytes:
        self._results[i] = res
        parser = self._outputs[i]
        logprobs = None
        if self.want_lp and out.token_ids:
            start = len(res.output_ids) - len(out.token_ids)
            logprobs = self._logprobs(out.token_ids, res.output_logprobs[start:], res.output_top_logprobs[start:])
        deltas = parser.feed(out.text) if parser.active else [{"content": out.text}] if out.text else []
        if out.finished and parser.active:
            deltas += parser.finish()
        if not deltas and logprobs is not None:
            deltas = [{}]  # the tokens' text is held back by a parser; their logprobs are not
        events = [self._delta(i, delta, logprobs if k == 0 else None) for k, delta in enumerate(deltas)]
        if out.finished:
            events.append(self._delta(i, {}, finish=parser.finish_reason(_finish(out.finish_reason))))
        return b"".join(events)


# ---------------------------------------------------------------- /v1/models
def models(state: "GatewayState") -> dict:
    return {"object": "list", "data": [_model_card(state)]}


def model(state: "GatewayState", model_id: str) -> dict:
    """`GET /v1/models/{id}` (the openai client's `models.retrieve`): the served name or the model path."""
    check_model(state, model_id)
    return _model_card(state)


def _model_card(state: "GatewayState") -> dict:
    return {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "radixserve",
            "root": state.model_path, "max_model_len": state.context_length}
