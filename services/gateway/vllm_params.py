"""vLLM's extra request parameters on the OpenAI routes: mapped where this server has the feature,
refused (400) where it does not; never silently ignored, since each changes what the client gets back.
(Its structured-output fields are services/gateway/grammar_fields.py's.)

- `include_stop_str_in_output` is SGLang's `no_stop_trim` (either may be given; they must agree);
- `truncate_prompt_tokens: k` keeps the prompt's last k tokens (-1: as many as the context holds), as
  vLLM does, before the context-length check;
- `use_beam_search`, `bad_words`, `allowed_token_ids`, `prompt_logprobs`, `logits_processors` name
  features this server does not have: a 400 that says so (for prompt logprobs, `echo` with `logprobs`
  on /v1/completions, or /generate's `return_logprob`, give them).
"""
from __future__ import annotations

from services.gateway.errors import bad_request
from services.gateway.fields import get_bool

_UNSUPPORTED = {
    "use_beam_search": "beam search is not supported",
    "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; /v1/completions with echo and logprobs returns the "
                       "prompt's logprobs",
    "logits_processors": "logits_processors is not supported",
}


def check_supported(body: dict) -> None:
    for key, why in _UNSUPPORTED.items():
        value = body.get(key)
        if value not in (None, False, [], {}):
            raise bad_request(why, key, code="unsupported_parameter")


def stop_trim_fields(body: dict) -> dict[str, bool]:
    """{"no_stop_trim": v} from vLLM's include_stop_str_in_output ({} when absent)."""
    if body.get("include_stop_str_in_output") is None:
        return {}
    keep = get_bool(body, "include_stop_str_in_output")
    if body.get("no_stop_trim") is not None and get_bool(body, "no_stop_trim") != keep:
        raise bad_request("include_stop_str_in_output and no_stop_trim disagree", "include_stop_str_in_output")
    return {"no_stop_trim": keep}


def kept_prompt_tokens(body: dict, context_length: int | None) -> int | None:
    """How many of a prompt's last tokens `truncate_prompt_tokens` keeps (-1: the context length); None:
    all of them."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1):
        raise bad_request("truncate_prompt_tokens must be an integer >= 1, or -1 (the context length)",
                          "truncate_prompt_tokens")
    return context_length if k == -1 else k
