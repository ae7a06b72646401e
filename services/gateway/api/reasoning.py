"""`reasoning_content` apart from `content`, for models that think inside `<think>...</think>`:
`deepseek-r1` starts in reasoning; `qwen3` reasons only when the answer (or the prompt) opens `<think>`,
and `<tool_call>` ends it too. A prompt that closes the block (`enable_thinking: false`) means no
reasoning; text after the block, less leading whitespace, is content; an answer cut off inside is all
reasoning. Incremental like the tool parsers (markers split across deltas held back); a whole answer is
one `feed` plus `finish`, so both paths agree."""
from __future__ import annotations

from shared.sampling_params import partial_stop_suffix

START, END = "<think>", "</think>"
# name -> (starts in reasoning unless the prompt closed the block, extra markers that end reasoning)
KINDS = {"deepseek-r1": (True, ()), "qwen3": (False, ("<tool_call>",)), "qwen3-thinking": (True, ("<tool_call>",))}
# --reasoning-parser's accepted spellings (the flag's choices, lower-cased) -> the kind.
ALIASES = {"deepseek-r1": "deepseek-r1", "deepseek_r1": "deepseek-r1", "r1": "deepseek-r1",
           "qwen3": "qwen3", "qwen3-thinking": "qwen3-thinking", "qwen3_thinking": "qwen3-thinking"}


class ReasoningParser:
    def __init__(self, kind: str, prompt: str = "", stream_reasoning: bool = True):
        forced, self.extra_ends = KINDS[kind]
        tail = prompt.rstrip()
        if tail.endswith(END):
            self._state = "content"  # thinking switched off by the template
        elif tail.endswith(START) or forced:
            self._state = "reasoning"
        else:
            self._state = "undecided"  # reasoning only if the answer opens <think>
        self._buf = ""
        self._at_start = True  # nothing of the answer consumed yet (a leading <think> is markup)
        self._strip_content = False  # after the block: leading whitespace is markup
        self.stream_reasoning = stream_reasoning
        self._held_reasoning = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state in ("undecided", "reasoning") and self._at_start:
                head = self._buf.lstrip()
                if not head or (START.startswith(head) and head != START):
                    break  # could still become <think>
                self._at_start = False
                if head.startswith(START):
                    self._buf = head[len(START):]
                    self._state = "reasoning"
                elif self._state == "undecided":
                    self._state = "content"
            if self._state == "reasoning":
                ends = [(self._buf.find(m), m) for m in (END, *self.extra_ends) if m in self._buf]
                if not ends:
                    keep = partial_stop_suffix(self._buf, (END, *self.extra_ends))
                    reasoning += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                at, marker = min(ends)
                reasoning += self._buf[:at]
                # </think> is markup; a tool call that ended the thinking is part of the answer.
                self._buf = self._buf[at + len(END):] if marker == END else self._buf[at:]
                self._state, self._strip_content = "content", True
                continue
            if self._state == "content":
                if self._strip_content:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._strip_content = False
                content += self._buf
                self._buf = ""
            break
        return self._release(reasoning, final=False), content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "content" or (self._state == "undecided" and rest.strip()):
            content = rest.lstrip() if self._strip_content else rest
            return self._release("", final=True), content
        reasoning = rest.lstrip()[len(START):] if rest.lstrip().startswith(START) else rest
        return self._release(reasoning if self._state == "reasoning" else "", final=True), ""

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _release(self, reasoning: str, final: bool) -> str:
        """With stream_reasoning off, reasoning comes out in one piece when the block ends."""
        if self.stream_reasoning:
            return reasoning
        self._held_reasoning += reasoning
        if final or self._state == "content":
            out, self._held_reasoning = self._held_reasoning, ""
            return out
        return ""
