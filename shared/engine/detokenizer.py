"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and BPE merges, so each step decodes a short window
and emits only the part that is stable (no trailing replacement character). Stop strings are searched in
the accumulated output text, so a stop string split across tokens is still found; text that could be the
beginning of a stop string is held back until it is resolved, so a streamed client never sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.tokenizer import Tokenizer

# How many tokens before the unread ones are decoded for context (merges and multi-byte characters).
_CONTEXT_TOKENS = 5


@dataclass
class DetokState:
    stop: list[str]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    context_len: int = 0  # leading prompt tokens in ids, decoded only for context
    text: str = ""  # all stable output text so far (before stop trimming)
    emitted: int = 0  # characters of `text` already returned to the caller
    matched_stop: str | None = None


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._special = tokenizer.special_ids

    def new_state(self, stop: list[str], skip_special_tokens: bool = True, no_stop_trim: bool = False,
                  prompt_tail: list[int] | None = None) -> DetokState:
        st = DetokState(stop=list(stop), skip_special_tokens=skip_special_tokens, no_stop_trim=no_stop_trim)
        # Seed with a few prompt tokens so the first output token decodes in context (leading spaces).
        if prompt_tail:
            st.ids = list(prompt_tail[-_CONTEXT_TOKENS:])
            st.prefix_offset = 0
            st.read_offset = len(st.ids)
            st.context_len = len(st.ids)
        return st

    def reset_output(self, st: DetokState, output_ids: list[int]) -> tuple[str, bool]:
        """The output tokens were rewritten (jump-forward re-tokenized the tail; its text only grows):
        decode them afresh, then emit what is new as usual."""
        st.ids = st.ids[:st.context_len] + list(output_ids)
        context = self._decode(st, st.ids[:st.context_len])
        full = self._decode(st, st.ids)
        text = full[len(context):] if full.startswith(context) else self._decode(st, list(output_ids))
        while text.endswith("\ufffd"):  # an unfinished character: wait for the rest
            text = text[:-1]
        if len(text) >= len(st.text):
            st.text = text
        st.read_offset = len(st.ids)
        st.prefix_offset = max(st.context_len, len(st.ids) - _CONTEXT_TOKENS)
        return self._emit(st)

    def _decode(self, st: DetokState, ids: list[int]) -> str:
        if st.skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self.tokenizer.raw.decode(ids, skip_special_tokens=False)

    def add_tokens(self, st: DetokState, new_ids: list[int]) -> tuple[str, bool]:
        """Feed new output tokens; returns (text safe to emit now, stop_string_hit)."""
        st.ids.extend(new_ids)
        prefix_text = self._decode(st, st.ids[st.prefix_offset:st.read_offset])
        full = self._decode(st, st.ids[st.prefix_offset:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            st.text += full[len(prefix_text):]
            st.prefix_offset = max(st.read_offset, len(st.ids) - _CONTEXT_TOKENS)
            # Keep the window relative: re-decode from prefix_offset next time.
            st.read_offset = len(st.ids)
        return self._emit(st)

    def flush(self, st: DetokState) -> str:
        """At the end of a request: whatever remains (held-back text, a dangling partial character)."""
        rest = self._decode(st, st.ids[st.read_offset:]) if st.read_offset < len(st.ids) else ""
        if rest and not rest.endswith("\ufffd"):
            st.text += rest
            st.read_offset = len(st.ids)
        if st.matched_stop is not None:
            return ""
        out = st.text[st.emitted:]
        st.emitted = len(st.text)
        return out

    def _emit(self, st: DetokState) -> tuple[str, bool]:
        if st.matched_stop is not None:
            return "", True
        if st.stop:
            # Search only where a new match can start.
            start = max(0, st.emitted - max(len(s) for s in st.stop))
            best = None
            for s in st.stop:
                pos = st.text.find(s, start)
                if pos != -1 and (best is None or pos < best[0]):
                    best = (pos, s)
            if best is not None:
                pos, s = best
                st.matched_stop = s
                end = pos + len(s) if st.no_stop_trim else pos
                out = st.text[st.emitted:end] if end > st.emitted else ""
                st.emitted = max(st.emitted, end)
                return out, True
            hold = _partial_stop_suffix(st.text, st.stop)
            end = len(st.text) - hold
        else:
            end = len(st.text)
        out = st.text[st.emitted:end] if end > st.emitted else ""
        st.emitted = max(st.emitted, end)
        return out, False

    def final_text(self, st: DetokState) -> str:
        """The whole output text as reported at the end (stop string trimmed unless no_stop_trim)."""
        if st.matched_stop is None:
            return st.text
        pos = st.text.find(st.matched_stop)
        return st.text[:pos + len(st.matched_stop)] if st.no_stop_trim else st.text[:pos]


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
