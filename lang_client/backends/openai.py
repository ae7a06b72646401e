"""Backend for hosted models behind the OpenAI API (chat completions; completions for `-instruct` models).

The `openai` package is imported only when this backend is built, so the SDK itself needs nothing.
Hosted APIs expose no prompt logprobs, so select() asks the model and maps its answer onto a choice.
"""
from __future__ import annotations

import json
from typing import Any

from lang_client.backends.base import BaseBackend, LogprobOptions, Prompt
from lang_client.chat_template import PLAIN, ChatTemplate
from lang_client.choices import ChoicesDecision
from lang_client.errors import NotSupportedError

# Native sampling keys -> OpenAI request keys; anything else a gen sets is refused, not dropped.
_PASSED = {"max_new_tokens": "max_tokens", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
           "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
_IGNORABLE = {"min_new_tokens", "stop_token_ids", "top_k", "min_p", "ignore_eos"}


class OpenAI(BaseBackend):
    supports_api_speculation = True

    def __init__(self, model_name: str, is_chat_model: bool | None = None, client: Any = None,
                 chat_template: ChatTemplate | None = None, strict: bool = False, **client_kwargs):
        if client is None:
            try:
                import openai
            except ImportError:
                raise ImportError("the OpenAI backend needs `pip install openai`") from None
            client = openai.OpenAI(**client_kwargs)
        self.client = client
        self.model_name = model_name
        self.is_chat_model = is_chat_model if is_chat_model is not None else "instruct" not in model_name
        # The template only decides how the local text looks; the API receives messages.
        self.chat_template = chat_template or PLAIN
        # strict: refuse sampling keys the API lacks (top_k, min_p...) instead of leaving them out.
        self.strict = strict
        self.calls = 0

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _request(self, sampling: dict[str, Any]) -> dict[str, Any]:
        if "regex" in sampling:
            raise NotSupportedError("regex-constrained gen is not supported by the OpenAI backend")
        req: dict[str, Any] = {"model": self.model_name}
        for key, value in sampling.items():
            if key in _PASSED:
                req[_PASSED[key]] = value
            elif key == "json_schema":
                schema = json.loads(value) if isinstance(value, str) else value
                req["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "output", "schema": schema}}
            elif key not in _IGNORABLE or self.strict:
                raise NotSupportedError(f"sampling parameter {key!r} is not supported by the OpenAI backend")
        return req

    def generate(self, prompt: Prompt, sampling: dict[str, Any],
                 logprobs: LogprobOptions | None = None) -> tuple[str, dict[str, Any]]:
        req = self._request(sampling)
        self.calls += 1
        if not self.is_chat_model:
            resp = self.client.completions.create(prompt=prompt.text, **req)
            choice = resp.choices[0]
            return choice.text, {"finish_reason": choice.finish_reason, "usage": _usage(resp)}
        if prompt.open_role != "assistant" or prompt.open_role_text:
            raise NotSupportedError(
                "chat models can only gen at the start of an assistant turn (s += assistant(gen(...))); "
                "text before a gen in that turn needs @function(num_api_spec_tokens=...) to be served")
        resp = self.client.chat.completions.create(messages=prompt.messages, **req)
        choice = resp.choices[0]
        return choice.message.content or "", {"finish_reason": choice.finish_reason, "usage": _usage(resp)}

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method) -> ChoicesDecision:
        longest = max(len(c) for c in choices)
        text, meta = self.generate(prompt, {"max_new_tokens": max(1, longest), "temperature": temperature})
        answer = text.strip()
        # The choice sharing the longest prefix with the answer; ties keep the earlier choice.
        best = max(range(len(choices)), key=lambda i: (_common_prefix(choices[i], answer), -i))
        return ChoicesDecision(choices[best], {"model_answer": text, **meta})


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _usage(resp) -> dict[str, Any] | None:
    usage = getattr(resp, "usage", None)
    if usage is None:
        return None
    return {"prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None)}
