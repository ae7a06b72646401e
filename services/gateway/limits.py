"""Caps on what one request may ask for."""
from __future__ import annotations

from dataclasses import dataclass

from shared import limits as shared_limits


@dataclass
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    # The whole body must arrive within this (a stalled upload would hold its handler and connection forever).
    body_read_timeout_s: float = 60.0
    max_json_depth: int = 64
    max_n: int = shared_limits.MAX_N
    max_batch: int = 256
    max_top_logprobs: int = shared_limits.MAX_TOP_LOGPROBS  # the worker enforces the same numbers
    grammar_timeout_s: float = 5.0  # regex / JSON schema compile time allowed before a 400
    # None: a request without max_tokens may fill the remaining context (OpenAI chat semantics).
    default_chat_max_tokens: int | None = None
    default_completion_max_tokens: int = 16  # OpenAI's documented default for /v1/completions
    default_native_max_new_tokens: int = 128  # SGLang's default for /generate
    # --strict: unknown sampling parameters are a 400 instead of a Warning header.
    strict_sampling_params: bool = False
