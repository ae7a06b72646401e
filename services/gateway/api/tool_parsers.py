"""Tool calls out of generated text, in the two formats models are trained on: `hermes` (Qwen, Hermes:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text outside them is content) and
`llama3` (the whole answer is `{"name": ..., "parameters": {...}}` objects separated by `;`, maybe after
`<|python_tag|>`). One incremental parser per choice: `feed(delta)` returns ("content", text),
("call", ToolCall) once a call's name is known and ("args", index, fragment) as its arguments arrive
(hermes streams them; llama3 calls come whole at the end). A whole response is fed at once, so both paths
agree; a block that is not a call of an offered function stays content."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from shared.sampling_params import partial_stop_suffix

# --tool-call-parser's accepted spellings (the flag's choices, lower-cased; SGLang's names for the same formats).
ALIASES = {"hermes": "hermes", "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes",
           "llama3": "llama3", "llama3_json": "llama3", "llama": "llama3"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def resolve_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser named (one of ALIASES), else the one the chat template's own markup implies, else None."""
    if name:
        return ALIASES[name]
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3"
    return None


def new_parser(kind: str, tool_names: set[str]) -> "ToolCallParser":
    return {"hermes": HermesParser, "llama3": Llama3JsonParser}[kind](tool_names)


Event = tuple  # ("content", str) | ("call", ToolCall) | ("args", int, str)


class ToolCallParser:
    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole response: (content, calls)."""
        events = self.feed(text) + self.finish()
        return "".join(e[1] for e in events if e[0] == "content"), list(self.calls)

    def _start(self, name: str, events: list[Event]) -> int:
        self.calls.append(ToolCall(name, ""))
        events.append(("call", self.calls[-1]))
        return len(self.calls) - 1

    def _args(self, index: int, fragment: str, events: list[Event]) -> None:
        if fragment:
            self.calls[index].arguments += fragment
            events.append(("args", index, fragment))

    def _whole_call(self, text: str, args_keys: tuple[str, ...], events: list[Event]) -> bool:
        """A complete call's JSON, as events; False when it is not a call of an offered function."""
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.tool_names:
            return False
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models double-encode
            try:
                args = json.loads(args)
            except ValueError:
                return False
        if not isinstance(args, dict):
            return False
        self._args(self._start(obj["name"], events), json.dumps(args, ensure_ascii=False), events)
        return True


# `{"name": "f", "arguments": ` up to the `{` that opens the arguments: from there they can stream.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: set[str]):
        super().__init__(tool_names)
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace between and after blocks is markup, not content
        self._streaming: tuple[int, int] | None = None  # (call index, where its arguments start in the body)
        self._sent = 0  # argument characters sent

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        events: list[Event] = []
        while True:
            if not self._in_call:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return events
                    self._after_call = False
                at = self._buf.find(self.START)
                if at < 0:
                    keep = partial_stop_suffix(self._buf, (self.START,))
                    self._content(self._buf[:len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                self._content(self._buf[:at], events)
                self._buf = self._buf[at + len(self.START):]  # the buffer now holds the block's body
                self._in_call, self._streaming, self._sent = True, None, 0
            end = self._buf.find(self.END)
            if end < 0:
                self._stream_args(self._buf, events)
                return events
            body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
            self._in_call = False
            self._close(body, events, complete=True)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._in_call:  # stopped before the closing tag (EOS right after the JSON, or max_tokens)
            self._in_call = False
            self._close(rest, events, complete=False)
        elif not self._after_call:
            self._content(rest, events)
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(("content", text))

    def _head(self, body: str) -> tuple[str, int] | None:
        """(function name, where the arguments start) once the body reads `{"name": "f", "arguments": {`."""
        m = _HERMES_HEAD.match(body)
        if m is None:
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        return (name, m.end()) if name in self.tool_names else None

    def _stream_args(self, body: str, events: list[Event]) -> None:
        if self._streaming is None:
            head = self._head(body)
            if head is None:
                return  # not (yet) a recognisable call: decided when the block closes
            self._streaming = (self._start(head[0], events), head[1])
        index, begin = self._streaming
        upto = len(body) - partial_stop_suffix(body, (self.END,))
        # Hold back a trailing run of `}` and whitespace: part of it closes the call object, not the arguments.
        args = body[begin:upto].rstrip(" \t\r\n}")
        if len(args) > self._sent:
            self._args(index, args[self._sent:], events)
            self._sent = len(args)

    def _close(self, body: str, events: list[Event], complete: bool) -> None:
        # A call cut off mid-arguments (max_tokens) stays a call with what was written, as OpenAI's do.
        # Whether the block arrived in pieces or at once, a call whose head reads right streams the same
        # way (so its arguments are the model's own text either way); any other block is judged whole.
        if self._streaming is None and self._head(body) is None:
            if self._whole_call(body.strip(), ("arguments", "parameters"), events):
                self._after_call = True
            else:
                self._content(self.START + body + (self.END if complete else ""), events)
            return
        self._stream_args(body, events)
        index, begin = self._streaming
        args = body[begin:].rstrip()
        if args.endswith("}") and _parses(body):
            args = args[:-1].rstrip()  # the call object's closing brace
        self._args(index, args[self._sent:], events)
        self._streaming = None
        self._after_call = True


class Llama3JsonParser(ToolCallParser):
    """A response that starts with `{` (or `<|python_tag|>`) is held until the end and parsed as calls;
    anything else streams as content at once."""
    TAG = "<|python_tag|>"

    def __init__(self, tool_names: set[str]):
        super().__init__(tool_names)
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "content", "calls"

    def feed(self, delta: str) -> list[Event]:
        if self._mode == "content":
            return [("content", delta)] if delta else []
        self._buf += delta
        head = self._buf.lstrip()
        if self._mode is None:
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            self._mode = "calls" if head.startswith(("{", self.TAG)) else "content"
            if self._mode == "content":
                out, self._buf = self._buf, ""
                return [("content", out)]
        return []

    def finish(self) -> list[Event]:
        text, self._buf = self._buf, ""
        if self._mode != "calls":
            return [("content", text)] if text else []
        body = text.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        pieces = _split_json_objects(body)
        events: list[Event] = []
        if pieces and all(self._whole_call(p, ("parameters", "arguments"), events) for p in pieces):
            return events
        self.calls.clear()
        return [("content", text)]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


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
