"""Chat templates as role prefix/suffix pairs, picked from the server's model_path.

The DSL renders roles itself (it sends plain text to /generate), so a template is just what goes before
and after each role's content.
"""
from __future__ import annotations

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

# Order matters: the first match wins (llama-3 before llama-2, mistral before plain names).
_BY_NAME: list[tuple[tuple[str, ...], ChatTemplate]] = [
    (("llama-3", "llama3", "llama_3"), LLAMA3),
    (("llama-2", "llama2", "llama_2", "codellama"), LLAMA2),
    (("mistral", "mixtral"), MISTRAL),
    (("gemma",), GEMMA),
    (("qwen", "yi-", "chatml", "hermes", "tiny-random"), CHATML),
]

TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, LLAMA2, MISTRAL, GEMMA, PLAIN)}


def template_for_model(model_path: str | None) -> ChatTemplate:
    """ChatML unless the model's name says otherwise."""
    name = (model_path or "").lower()
    for keys, template in _BY_NAME:
        if any(k in name for k in keys):
            return template
    return CHATML


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}") from None
