"""How select() picks a choice from per-token logprobs of `prompt + choice`.

Each method sees, per choice, the input-token logprob entries the server returned from
logprob_start_len on (`[logprob, token_id, text]`, the first may hold a null logprob).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _logprobs(entries: list) -> list[float]:
    return [e[0] for e in entries if e and e[0] is not None]


class TokenLengthNormalized:
    """Mean logprob per token: long choices are not punished for being long."""
    name = "token_length_normalized"

    def __call__(self, choices: list[str], input_token_logprobs: list[list]) -> ChoicesDecision:
        scores = []
        for entries in input_token_logprobs:
            lps = _logprobs(entries)
            scores.append(sum(lps) / len(lps) if lps else -math.inf)
        best = max(range(len(choices)), key=lambda i: scores[i])
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": scores,
                                               "input_token_logprobs": input_token_logprobs})


class GreedyTokenSelection:
    """Compare choices token by token, the most likely token first; ties go to the next position."""
    name = "greedy_token_selection"

    def __call__(self, choices: list[str], input_token_logprobs: list[list]) -> ChoicesDecision:
        seqs = [_logprobs(e) for e in input_token_logprobs]
        width = max((len(s) for s in seqs), default=0)
        padded = [s + [-math.inf] * (width - len(s)) for s in seqs]
        best = max(range(len(choices)), key=lambda i: padded[i])
        return ChoicesDecision(choices[best], {"input_token_logprobs": input_token_logprobs})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()


def resolve_method(method: Any):
    if method is None:
        return token_length_normalized
    if isinstance(method, str):
        for m in (token_length_normalized, greedy_token_selection):
            if m.name == method:
                return m
        raise ValueError(f"unknown choices_method {method!r}")
    if callable(method):
        return method
    raise TypeError("choices_method must be a name or a callable")
