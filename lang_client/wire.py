"""What the SDK and the server's program executor (services/gateway/programs/) both read, defined once here
(standard library only): the traced IR's version, scoped names and if transforms, and the /generate bodies
a select and a fork warm-up send.

A scoped name is "name" in the main stream, "<scope>.name" inside a fork branch (lang_client/tracer.py).
An if node may apply these str methods, by name, to a variable before comparing it
(`s["x"].strip().lower() == "yes"`).

select = two requests: the prompt alone (max_new_tokens 0) to learn its token count, then one batch that
scores `prompt + choice` for every choice from two tokens before the choice (the prompt's tail may merge with
the choice's head: token healing). The scores are picked by lang_client.choices.
fork warm-up = one prefill of the shared prefix before the branches start, so each finds it in the cache.
"""
from __future__ import annotations

from typing import Any

IR_VERSION = 1
IF_TRANSFORMS = ("strip", "lstrip", "rstrip", "lower", "upper", "casefold")


def scoped_name(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


def apply_transforms(value: str, transforms) -> str:
    for method in transforms:  # names from IF_TRANSFORMS
        value = getattr(str, method)(value)
    return value


def prefill_body(text: str) -> dict[str, Any]:
    """Prefill only: the text lands in the radix cache; the answer's meta_info has prompt_tokens."""
    return {"text": text, "sampling_params": {"max_new_tokens": 0}}


def should_warm_fork(width: int, text: str) -> bool:
    """A warm-up is worth a request only when several branches will share a non-empty prefix."""
    return width > 1 and bool(text)


def choice_scoring_body(text: str, choices: list[str], temperature: float, prompt_tokens: int) -> dict[str, Any]:
    return {
        "text": [text + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": max(prompt_tokens - 2, 0),
    }


def choice_logprobs(answers: Any, n_choices: int) -> list[list]:
    """Per choice, its input-token logprob entries, from the scoring batch's answer."""
    if not isinstance(answers, list) or len(answers) != n_choices:
        raise ValueError("select: the server did not answer the batch with one result per choice")
    return [a["meta_info"]["input_token_logprobs"] for a in answers]
