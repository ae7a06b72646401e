"""Chat templates as role prefix/suffix pairs, picked from the server's model_path.

The DSL renders roles itself (it sends plain text to /generate), so a template is just what goes before
and after each role's content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict[str, tuple[str, str]] = field(default_factory=dict)

    def prefix(self, role: str) -> str:
        return self._pair(role)[0]

    def suffix(self, role: str) -> str:
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        return self.roles[role]


CHATML = ChatTemplate("chatml", {
    r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")})

LLAMA3 = ChatTemplate("llama-3", {
    r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ("system", "user", "assistant")})

LLAMA2 = ChatTemplate("llama-2", {
    "system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
    "user": ("[INST] ", " [/INST]"),
    "assistant": (" ", " </s><s>"),
})

MISTRAL = ChatTemplate("mistral", {
    "system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"),
    "user": ("[INST] ", " [/INST]"),
    "assistant": (" ", "</s>"),
})

GEMMA = ChatTemplate("gemma", {
    # Gemma has no system turn; a system message becomes a user turn, as its own template does.
    "system": ("<start_of_turn>user\n", "<end_of_turn>\n"),
    "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
    "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
})

PLAIN = ChatTemplate("plain", {
    "system": ("SYSTEM: ", "\n"),
    "user": ("USER: ", "\n"),
    "assistant": ("ASSISTANT: ", "\n"),
})

# What SGLang's frontend uses for a model none of its rules name (its "default" template): a program
# sends the same text through either client.
DEFAULT = ChatTemplate("default", {
    "system": ("SYSTEM:", "\n"),
    "user": ("USER:", "\n"),
    "assistant": ("ASSISTANT:", "\n"),
})

# SGLang's frontend rules, in its order (the first match wins), for the templates we carry: a chat or
# instruct model's name picks its family; anything else (base models, unknown names) gets DEFAULT.
_RULES: list[tuple[str, ChatTemplate]] = [
    (r"llama-2.*chat|codellama.*instruct", LLAMA2),
    (r"pixtral|(mistral|mixtral).*instruct", MISTRAL),
    (r"llama-3.*instruct", LLAMA3),
    (r"tinyllama|qwen.*(chat|instruct)|yi-1\.5.*chat", CHATML),
    (r"(gemma.*it)|(gemma-3)", GEMMA),
]

TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, LLAMA2, MISTRAL, GEMMA, PLAIN, DEFAULT)}


def template_for_model(model_path: str | None) -> ChatTemplate:
    """The template SGLang's frontend would pick for this model path (DEFAULT when no rule names it)."""
    name = model_path or ""
    for pattern, template in _RULES:
        if re.search(pattern, name, re.IGNORECASE):
            return template
    return DEFAULT


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}") from None
