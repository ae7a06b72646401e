"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and BPE merges, so each step decodes a short window
and emits only the part that is stable (no trailing replacement character). Stop strings are searched in
the accumulated output text, so a stop string split across tokens is still found; text that could be the
beginning of a stop string is held back until it is resolved, so a streamed client never sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import decoders

from shared.sampling_params import compile_stop_regex, partial_stop_suffix
from shared.tokenizer import Tokenizer

# How many tokens before the unread ones are decoded for context (merges and multi-byte characters).
_CONTEXT_TOKENS = 5
# A stop_regex match may start this many characters before the newly decoded text (it must end in the new
# text: anything earlier was searched already). Bounds the per-step work on long outputs.
_REGEX_LOOKBACK = 1024
# A pattern that takes longer than this on one step ends its request (it runs on the engine thread).
_REGEX_TIMEOUT_S = 0.05


@dataclass
class DetokState:
    stop: list[str]
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    context_len: int = 0  # leading prompt tokens in ids, decoded only for context
    context_text: str | None = None  # their text (reset_output's, decoded once)
    # reset_output's last whole-character point: the first `anchor_len` output tokens decode to
    # `anchor_text`, which ends on a whole character (byte-level decoders only, see reset_output).
    anchor_len: int = 0
    anchor_text: str = ""
    text: str = ""  # all stable output text so far (before stop trimming)
    emitted: int = 0  # characters of `text` already returned to the caller
    matched_stop: str | None = None
    stop_regex: list = field(default_factory=list)  # compiled patterns
    regex_scanned: int = 0  # characters of `text` already searched for stop_regex
    regex_end: int | None = None  # end of the stop_regex match in `text`: the output ends there
    regex_error: str | None = None


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._special = tokenizer.special_ids
        # A byte-level decoder (GPT-2, Llama 3, Qwen...) writes the tokens' bytes one after another and
        # decodes them as UTF-8 once: tokens split after a whole character decode to the two parts'
        # texts joined. Others (SentencePiece's leading-space strip, WordPiece's "##") may not.
        self._bytewise = isinstance(getattr(tokenizer.raw, "decoder", None), decoders.ByteLevel)

    def new_state(self, stop: list[str], skip_special_tokens: bool = True, no_stop_trim: bool = False,
                  prompt_tail: list[int] | None = None, stop_regex: list[str] | None = None) -> DetokState:
        st = DetokState(stop=list(stop), skip_special_tokens=skip_special_tokens, no_stop_trim=no_stop_trim,
                        stop_regex=[compile_stop_regex(p) for p in stop_regex or []])
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
        unchanged = self._anchor_holds(st, output_ids)  # before st.ids, which the anchor was read from, changes
        st.ids = st.ids[:st.context_len] + list(output_ids)
        if st.context_text is None:
            st.context_text = self._decode(st, st.ids[:st.context_len])
        context = st.context_text
        if self._bytewise and not context.endswith("\ufffd"):
            # The context ends on a whole character, so its text and the output's join: decode only the
            # output past the anchor (a jump rewrites the last token at most), not the whole of it again.
            if not unchanged:
                st.anchor_len, st.anchor_text = 0, ""
            text = st.anchor_text + self._decode(st, list(output_ids[st.anchor_len:]))
            if not text.endswith("\ufffd"):
                st.anchor_len, st.anchor_text = len(output_ids), text
        else:
            full = self._decode(st, st.ids)
            text = full[len(context):] if full.startswith(context) else self._decode(st, list(output_ids))
        while text.endswith("\ufffd"):  # an unfinished character: wait for the rest
            text = text[:-1]
        if len(text) >= len(st.text):
            st.text = text
        st.read_offset = len(st.ids)
        st.prefix_offset = max(st.context_len, len(st.ids) - _CONTEXT_TOKENS)
        return self._emit(st)

    @staticmethod
    def _anchor_holds(st: DetokState, output_ids: list[int]) -> bool:
        """The output's first anchor_len tokens are still those the anchor was decoded from (st.ids has
        only grown past them since: add_tokens appends, reset_output moves the anchor)."""
        c, k = st.context_len, st.anchor_len
        return 0 < k <= len(output_ids) and st.ids[c:c + k] == output_ids[:k]

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
            hold = partial_stop_suffix(st.text, st.stop)
            end = len(st.text) - hold
        else:
            end = len(st.text)
        if st.stop_regex and self._search_regex(st):
            end = st.regex_end
            out = st.text[st.emitted:end] if end > st.emitted else ""
            st.emitted = max(st.emitted, end)
            return out, True
        out = st.text[st.emitted:end] if end > st.emitted else ""
        st.emitted = max(st.emitted, end)
        return out, False

    def _search_regex(self, st: DetokState) -> bool:
        """Earliest stop_regex match ending in the text decoded since the last search. SGLang keeps the
        matched text in the output (no trimming), and so do we."""
        if len(st.text) <= st.regex_scanned:
            return False
        start = max(0, st.regex_scanned - _REGEX_LOOKBACK)
        st.regex_scanned = len(st.text)
        best = None
        for pattern in st.stop_regex:
            try:
                m = pattern.search(st.text, start, timeout=_REGEX_TIMEOUT_S)
            except TimeoutError:
                st.regex_error = f"stop_regex {pattern.pattern!r} took too long to match"
                st.matched_stop, st.regex_end = "", len(st.text)
                return True
            if m is not None and (best is None or m.end() < best.end()):
                best = m
        if best is None:
            return False
        st.matched_stop, st.regex_end = best.group(0), best.end()
        return True

    def final_text(self, st: DetokState) -> str:
        """The whole output text as reported at the end (stop string trimmed unless no_stop_trim)."""
        if st.regex_end is not None:
            return st.text[:st.regex_end]
        if st.matched_stop is None:
            return st.text
        pos = st.text.find(st.matched_stop)
        return st.text[:pos + len(st.matched_stop)] if st.no_stop_trim else st.text[:pos]
