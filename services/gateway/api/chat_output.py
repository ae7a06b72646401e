"""One choice's generated text as OpenAI chat fields: reasoning split off first, then tool calls parsed
out of what remains. Streaming yields OpenAI deltas (`reasoning_content`, `content`, and per call
`{index, id, type, function: {name, arguments: ""}}` followed by `{index, function: {arguments}}`);
the whole-answer path feeds the same parsers, so both agree."""
from __future__ import annotations

from services.gateway.api.chat_request import ChatSpec
from services.gateway.api.reasoning import ReasoningParser
from services.gateway.api.tool_parsers import ToolCall, new_parser


class ChoiceOutput:
    def __init__(self, spec: ChatSpec, prompt_text: str):
        self.reasoning = (ReasoningParser(spec.reasoning_parser, prompt_text, spec.stream_reasoning)
                          if spec.reasoning_parser else None)
        self.tools = new_parser(spec.tool_parser, spec.tool_names) if spec.tool_parser else None
        self.calls: list[ToolCall] = []

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, delta: str) -> list[dict]:
        return self._route(*(self.reasoning.feed(delta) if self.reasoning else ("", delta)), final=False)

    def finish(self) -> list[dict]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(reasoning, content, final=True)

    def message(self, text: str) -> dict:
        """The non-streaming `message` of a choice."""
        reasoning, content = [], []
        for d in self.feed(text) + self.finish():
            reasoning.append(d.get("reasoning_content", ""))
            content.append(d.get("content", ""))
        msg: dict = {"role": "assistant", "content": "".join(content)}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(reasoning) or None
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
            if not msg["content"].strip():
                msg["content"] = None
        return msg

    def finish_reason(self, base: str | None) -> str | None:
        return "tool_calls" if self.calls and base == "stop" else base

    def _route(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out: list[dict] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        events = self.tools.feed(content) + (self.tools.finish() if final else [])
        for event in events:
            if event[0] == "content":
                out.append({"content": event[1]})
            elif event[0] == "call":
                call = event[1]
                out.append({"tool_calls": [{"index": len(self.calls), "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
                self.calls.append(call)
            else:
                out.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        # Consecutive content (or argument) pieces of one step go out as one delta.
        return _merge(out)


def _merge(deltas: list[dict]) -> list[dict]:
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and set(prev) == set(d) == {"content"}:
            prev["content"] += d["content"]
        elif (prev is not None and set(prev) == set(d) == {"tool_calls"} and set(prev["tool_calls"][0]) == {"index", "function"}
              and set(d["tool_calls"][0]) == {"index", "function"} and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
            prev["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
        else:
            out.append(d)
    return out
