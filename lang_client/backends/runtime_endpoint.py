"""Backend for a server speaking SGLang's native API (/generate, /get_model_info, /flush_cache)."""
from __future__ import annotations

from typing import Any, Iterator

from lang_client import wire
from lang_client._http import HttpClient
from lang_client.backends.base import BaseBackend, LogprobOptions, Prompt
from lang_client.chat_template import ChatTemplate, get_chat_template, template_for_model
from lang_client.choices import ChoicesDecision
from lang_client.errors import BackendError


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: str | ChatTemplate | None = None):
        self.http = HttpClient(base_url, api_key, timeout)
        self.base_url = self.http.base_url
        self.model_info = self.http.get_json("/get_model_info")
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or template_for_model(self.model_info.get("model_path"))

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_server_info(self) -> dict:
        return self.http.get_json("/server_info")

    def flush_cache(self) -> None:
        self.http.post_json("/flush_cache", {})

    def cache_prefix(self, text: str) -> None:
        # max_new_tokens 0: prefill only, so the prefix lands in the radix tree before the children ask.
        self.http.post_json("/generate", wire.prefill_body(text))

    def _body(self, prompt: Prompt, sampling: dict[str, Any], logprobs: LogprobOptions | None,
              stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"text": prompt.text, "sampling_params": dict(sampling)}
        if stream:
            body["stream"] = True
        if logprobs is not None:
            for key in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
                value = getattr(logprobs, key)
                if value is not None:  # top-level keys only when set, as the reference client does
                    body[key] = value
        return body

    def generate(self, prompt, sampling, logprobs=None):
        answer = self.http.post_json("/generate", self._body(prompt, sampling, logprobs, stream=False))
        return answer["text"], answer.get("meta_info", {})

    def generate_stream(self, prompt, sampling, logprobs=None) -> Iterator[tuple[str, dict]]:
        seen = 0
        for event in self.http.post_sse("/generate", self._body(prompt, sampling, logprobs, stream=True)):
            text = event.get("text", "")  # cumulative: slice off what was already yielded
            yield text[seen:], event.get("meta_info", {})
            seen = len(text)

    def select(self, prompt, choices, temperature, method) -> ChoicesDecision:
        first = self.http.post_json("/generate", wire.prefill_body(prompt.text))
        answers = self.http.post_json("/generate", wire.choice_scoring_body(
            prompt.text, choices, temperature, first["meta_info"]["prompt_tokens"]))
        try:
            return method(choices, wire.choice_logprobs(answers, len(choices)))
        except ValueError as e:
            raise BackendError(str(e)) from None

    def run_program(self, ir: dict, args: dict, stream: bool):
        body = {"program": ir, "args": args, "stream": stream}
        if stream:
            return self.http.post_sse("/v1/programs", body)
        return self.http.post_json("/v1/programs", body)
