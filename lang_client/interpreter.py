"""Interpreter mode: every program state is a stream, a thread draining a queue of expressions.

Appending never blocks the program; reading a variable waits only for the gen that defines it, and
reading the text waits for the queue to drain. Forks are new streams, so their gens run concurrently.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from lang_client import wire
from lang_client.backends.base import BaseBackend, LogprobOptions, Prompt
from lang_client.chat_template import ChatTemplate
from lang_client.choices import resolve_method
from lang_client.errors import LangError
from lang_client.expr import Concat, Expr, Gen, Image, RoleBegin, RoleEnd, Select, Text
from lang_client.speculative import SpecBuffer, cut_at_stop

_END = object()


@dataclass(eq=False)
class Assign(Expr):
    """Set a variable in stream order (set_var, join's gathered values)."""
    name: str
    value: Any

    def var_names(self) -> list[str]:
        return [self.name]


class StreamExecutor:
    def __init__(self, backend: BaseBackend, default_sampling: dict[str, Any] | None = None,
                 chat_template: ChatTemplate | None = None, stream: bool = False,
                 num_api_spec_tokens: int | None = None):
        self.backend = backend
        self.default_sampling = dict(default_sampling or {})
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.spec = (SpecBuffer(num_api_spec_tokens)
                     if num_api_spec_tokens and backend.supports_api_speculation else None)

        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_start = 0
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_events: dict[str, threading.Event] = {}
        self.defined_here: list[str] = []  # names set by this stream (a fork's own results, for join)
        self.fork_start = 0
        self.children: list[StreamExecutor] = []
        self.error_: BaseException | None = None

        self.queue: queue.Queue = queue.Queue()
        # (variable name or None, text chunk); None marks the end. Only the streamed root has one.
        self.out_queue: queue.Queue | None = queue.Queue() if stream else None
        self.thread = threading.Thread(target=self._worker, daemon=True, name="lang-stream")
        self.thread.start()

    # ---- called from the program's thread ----
    def submit(self, expr: Expr) -> None:
        for name in expr.var_names():
            self.var_events[name] = threading.Event()  # a redefinition makes later reads wait again
        self.queue.put(expr)

    def sync(self) -> None:
        self.queue.join()

    def end(self) -> None:
        for child in self.children:
            child.end()
        self.queue.put(_END)

    def get_var(self, name: str) -> Any:
        event = self.var_events.get(name)
        if event is None:
            raise KeyError(f"no variable {name!r} in this program state")
        event.wait()
        if self.error_ is not None:
            raise self.error_
        return self.variables[name]

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def fork(self, size: int) -> list["StreamExecutor"]:
        self.sync()
        if self.error_ is not None:
            raise self.error_
        if wire.should_warm_fork(size, self.text_):
            # Synchronous on purpose: the prefix must be cached before any child's request arrives.
            self.backend.cache_prefix(self.text_)
        children = [StreamExecutor(self.backend, self.default_sampling, self.chat_template,
                                   num_api_spec_tokens=self.num_api_spec_tokens) for _ in range(size)]
        for child in children:
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role, child.cur_role_start = self.cur_role, self.cur_role_start
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            for name in self.variables:
                child.var_events[name] = _set_event()
            child.fork_start = len(self.text_)
        self.children.extend(children)
        return children

    # ---- the stream's own thread ----
    def _worker(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is _END:
                    break
                if self.error_ is None:
                    self._execute(item)
            except BaseException as e:  # kept for the reader; the stream drains the rest untouched
                self.error_ = e
                for event in self.var_events.values():
                    event.set()
            finally:
                self.queue.task_done()
        for event in self.var_events.values():
            event.set()  # a read of a never-produced variable must not hang after the end
        if self.out_queue is not None:
            self.out_queue.put(None)

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Text):
            self._append(expr.value)
            if self.spec is not None:
                self.spec.feed_literal(expr.value)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Assign):
            self._define(expr.name, expr.value, None)
        elif isinstance(expr, Image):
            self.backend.image(expr.path)
        else:
            raise TypeError(f"unknown expression {type(expr).__name__}")

    def _append(self, text: str, var: str | None = None) -> None:
        self.text_ += text
        if self.out_queue is not None and text:
            self.out_queue.put((var, text))

    def _define(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        if name not in self.defined_here:
            self.defined_here.append(name)
        self.var_events.setdefault(name, threading.Event()).set()

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise LangError(f"cannot begin role {role!r} inside role {self.cur_role!r}")
        self._append(self.chat_template.prefix(role))
        self.cur_role, self.cur_role_start = role, len(self.text_)
        if self.spec is not None:
            self.spec.reset()

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise LangError(f"cannot end role {role!r}: the open role is {self.cur_role!r}")
        self.messages_.append({"role": role, "content": self.text_[self.cur_role_start:]})
        self._append(self.chat_template.suffix(role))
        self.cur_role = None
        if self.spec is not None:
            self.spec.reset()

    def _prompt(self) -> Prompt:
        return Prompt(self.text_, list(self.messages_), self.cur_role,
                      self.text_[self.cur_role_start:] if self.cur_role else "")

    def _gen(self, g: Gen) -> None:
        sampling = {**self.default_sampling, **g.sampling}
        logprobs = LogprobOptions(g.return_logprob, g.logprob_start_len, g.top_logprobs_num,
                                  g.return_text_in_logprobs)
        if self.spec is not None and self.spec.applies(sampling) and not g.return_logprob:
            value, meta = self._speculative_gen(sampling)
            self._append(value, g.name)
        elif self.stream:
            value, meta = "", {}
            for delta, meta in self.backend.generate_stream(self._prompt(), sampling, logprobs):
                value += delta
                self._append(delta, g.name)
        else:
            value, meta = self.backend.generate(self._prompt(), sampling, logprobs)
            self._append(value, g.name)
        self._define(g.name, value, meta)

    def _speculative_gen(self, sampling: dict) -> tuple[str, dict]:
        value = self.spec.take(sampling["stop"])
        if value is not None:
            return value, {"speculative": "served_from_previous_call"}
        text, meta = self.backend.generate(self._prompt(), self.spec.request(sampling))
        value, rest = cut_at_stop(text, sampling["stop"])
        self.spec.keep(rest)
        return value, meta

    def _select(self, sel: Select) -> None:
        decision = self.backend.select(self._prompt(), sel.choices, sel.temperature,
                                       resolve_method(sel.choices_method))
        self._append(decision.decision, sel.name)
        self._define(sel.name, decision.decision, decision.meta_info)


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event
