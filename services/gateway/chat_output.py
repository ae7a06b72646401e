"""One choice's generated text as OpenAI chat fields: reasoning split off first, then tool calls parsed
out of what remains. Streaming yields OpenAI deltas (`reasoning_content`, `content`, and per call
`{index, id, type, function: {name, arguments: ""}}` followed by `{index, function: {arguments}}`);
the whole-answer path feeds the same parsers, so both agree."""
from __future__ import annotations

from services.gateway.chat_request import ChatSpec
from services.gateway.reasoning import ReasoningParser
from services.gateway.tool_parsers import ToolCall, new_parser


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
        reasoning, content, calls = [], [], []
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
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
        if content:
            out.append({"content": content})
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return out
