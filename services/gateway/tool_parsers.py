"""Tool calls out of generated text, in the two formats models are trained on:

- `hermes` (Qwen 2.5/3, Hermes, many fine-tunes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number of blocks, text outside them is content;
- `llama3` (Llama 3.1/3.2/3.3 JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`,
  several calls separated by `;`, optionally after `<|python_tag|>`.

One incremental parser per choice: `feed(delta)` returns the content that is certainly not part of a call
and the calls completed so far; `finish()` flushes the rest. A whole response is parsed by feeding it at
once, so streamed and non-streamed answers agree. A block that does not parse, or names a function the
request did not offer, stays content: nothing the model wrote is dropped.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3")
# Accepted spellings (SGLang's names for the same formats).
ALIASES = {"hermes": "hermes", "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes",
           "llama3": "llama3", "llama3_json": "llama3", "llama": "llama3"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def resolve_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser asked for by name, else the one the chat template's own markup implies, else None."""
    if name:
        key = ALIASES.get(name.lower())
        if key is None:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(ALIASES)}")
        return key
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3"
    return None


def new_parser(kind: str, tool_names: set[str]) -> "ToolCallParser":
    return {"hermes": HermesParser, "llama3": Llama3JsonParser}[kind](tool_names)


class ToolCallParser:
    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole response: (content, calls)."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more

    def _call_from_json(self, text: str, args_keys: tuple[str, ...]) -> ToolCall | None:
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.tool_names:
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models double-encode
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        call = ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return call


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: set[str]):
        super().__init__(tool_names)
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace between and after blocks is markup, not content

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if not self._in_call:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return content, calls
                    self._after_call = False
                at = self._buf.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.START)
                    content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, calls
                content += self._buf[:at]
                self._buf = self._buf[at:]
                self._in_call = True
            end = self._buf.find(self.END)
            if end < 0:
                return content, calls
            block = self._buf[:end + len(self.END)]
            self._buf = self._buf[end + len(self.END):]
            self._in_call = False
            call = self._call_from_json(block[len(self.START):-len(self.END)], ("arguments", "parameters"))
            if call is None:
                content += block
            else:
                calls.append(call)
                self._after_call = True

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._in_call:  # stopped before the closing tag (EOS right after the JSON, or max_tokens)
            self._in_call = False
            call = self._call_from_json(rest[len(self.START):].strip(), ("arguments", "parameters"))
            if call is not None:
                return "", [call]
        return rest, []


class Llama3JsonParser(ToolCallParser):
    """A response that starts with `{` (or `<|python_tag|>`) is held until the end and parsed as calls;
    anything else streams as content at once."""
    TAG = "<|python_tag|>"

    def __init__(self, tool_names: set[str]):
        super().__init__(tool_names)
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "content", "calls"

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "content":
            return delta, []
        self._buf += delta
        head = self._buf.lstrip()
        if self._mode is None:
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return "", []
            self._mode = "calls" if head.startswith(("{", self.TAG)) else "content"
            if self._mode == "content":
                out, self._buf = self._buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if self._mode != "calls":
            return text, []
        body = text.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        calls = []
        for piece in _split_json_objects(body):
            call = self._call_from_json(piece, ("parameters", "arguments"))
            if call is None:
                self.calls.clear()
                return text, []
            calls.append(call)
        return ("", calls) if calls else (text, [])


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` into its objects (semicolons inside strings are left alone)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = dec.raw_decode(text, i)
        except ValueError:
            return [text[i:]]  # unparseable: the caller refuses it
        out.append(text[i:end])
        i = end
    return out
