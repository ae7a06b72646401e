"""What a backend must do for the interpreter. The interpreter owns the text; a backend only answers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from lang_client.chat_template import CHATML, ChatTemplate
from lang_client.choices import ChoicesDecision
from lang_client.errors import NotSupportedError


@dataclass(frozen=True)
class Prompt:
    """A snapshot of a stream at the point a gen/select runs."""
    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None     # role begun but not ended
    open_role_text: str = ""         # what that role holds so far


@dataclass(frozen=True)
class LogprobOptions:
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None


class BaseBackend:
    # The OpenAI backend sets this: its gens may be asked for more tokens than needed (paper §5).
    supports_api_speculation = False

    def get_chat_template(self) -> ChatTemplate:
        return CHATML

    def cache_prefix(self, text: str) -> None:
        """Hint that several requests will share `text` (sent before fork children)."""

    def generate(self, prompt: Prompt, sampling: dict[str, Any],
                 logprobs: LogprobOptions | None = None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, prompt: Prompt, sampling: dict[str, Any],
                        logprobs: LogprobOptions | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (new text, meta_info); default: one chunk."""
        yield self.generate(prompt, sampling, logprobs)

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method) -> ChoicesDecision:
        raise NotImplementedError

    def image(self, path: str) -> None:
        raise NotSupportedError("image input is not supported by this model (text-only backend)")

    def flush_cache(self) -> None:
        pass

    def run_program(self, ir: dict, args: dict, stream: bool):
        raise NotSupportedError(f"{type(self).__name__} cannot run programs remotely; use RuntimeEndpoint")
