"""API speculative execution (SGLang paper §5), for backends billed per call.

A gen with a stop string is asked for more tokens than it needs, without the stop. What comes after the
stop is kept: if the program's next literal text matches it, the following gen is cut out of it instead
of costing another call. A mismatch just drops the guess.
"""
from __future__ import annotations

from dataclasses import dataclass


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """(text before the earliest stop, rest starting at that stop) or (text, None) when no stop occurs."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i, _ = min(hits)
    return text[:i], text[i:]


@dataclass
class SpecBuffer:
    num_tokens: int
    pending: str = ""
    hits: int = 0      # gens served from a guess
    misses: int = 0    # guesses dropped because the program went elsewhere

    def applies(self, sampling: dict) -> bool:
        """Only plain stop-terminated gens can be speculated (a regex needs the server's grammar)."""
        return bool(sampling.get("stop")) and not any(k in sampling for k in ("regex", "json_schema", "stop_regex"))

    def take(self, stops: list[str]) -> str | None:
        """Serve a gen from the guess when it holds the gen's whole answer (a stop follows it)."""
        if not self.pending:
            return None
        value, rest = cut_at_stop(self.pending, stops)
        if rest is None:  # the guess ran out before the gen would stop: cannot know the answer
            self.pending = ""
            return None
        self.pending = rest
        self.hits += 1
        return value

    def keep(self, rest: str | None) -> None:
        self.pending = rest or ""

    def feed_literal(self, text: str) -> None:
        """The program appended `text`; keep the guess only if the model had predicted it."""
        if not self.pending or not text:
            return
        if self.pending.startswith(text):
            self.pending = self.pending[len(text):]
        else:
            self.pending = ""
            self.misses += 1

    def reset(self) -> None:
        self.pending = ""

    def request(self, sampling: dict) -> dict:
        """The sampling params actually sent: no stop, enough tokens to cover the guess."""
        asked = {k: v for k, v in sampling.items() if k != "stop"}
        asked["max_new_tokens"] = max(sampling.get("max_new_tokens", 0), self.num_tokens)
        return asked
