"""Chat templates rendered exactly as `transformers` renders them.

transformers is installed wherever we run (xgrammar requires it and imports it), so rather than keep a
Jinja environment of our own that drifts from it (loop controls, `tojson` without ASCII escaping,
`raise_exception`, `strftime_now`, namespaces...), we call its renderer. What `apply_chat_template`
does around the renderer is done here the same way: messages with None values lose those keys, the
tokenizer's special tokens are template variables that caller kwargs override, and
`continue_final_message` excludes `add_generation_prompt`.

`render_chat` is a pure function (no I/O, no shared state beyond transformers' compile cache), safe to
call from a thread pool off the event loop.
"""
from __future__ import annotations

from typing import Any

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or cannot render it."""


def compile_template(template: str) -> None:
    """Parse once at load time, so a template that cannot serve fails there (and is cached for later)."""
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def render_chat(template: str, messages: list[dict], *, tools: list[dict] | None = None,
                documents: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, special_tokens: dict[str, str] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages`, as `tokenizer.apply_chat_template(..., tokenize=False)` gives it."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    if not messages:
        raise ChatTemplateError("the conversation is empty")
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {**(special_tokens or {}), **(template_kwargs or {})}
    for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
        variables.pop(reserved, None)
    try:
        rendered, _ = render_jinja_template(
            conversations=[clean], tools=tools, documents=documents, chat_template=template,
            continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt,
            **variables)
    except jinja2.TemplateError as e:  # raise_exception in the template lands here too
        raise ChatTemplateError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - transformers' own checks, or a template's arithmetic on odd input
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from None
    return rendered[0]
