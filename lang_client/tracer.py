"""Compiler mode's front half: run a program on placeholder states and record an IR of plain data.

The IR (version 1) is what `POST /v1/programs` takes; it holds only dicts, lists, strings, numbers,
booleans and null, so JSON and msgpack carry it, and the server never runs user code:

    {"version": 1, "name": str, "args": [unbound argument names], "nodes": [node, ...]}
    node = {"op": "text", "text": str}
         | {"op": "arg", "name": str}                          # an argument's value, bound by the request
         | {"op": "role_begin" | "role_end", "role": str, "text": str}   # rendered role marker
         | {"op": "gen", "name": str|null, "sampling_params": {native keys},
            ["return_logprob": bool, "logprob_start_len": int, "top_logprobs_num": int]}
         | {"op": "select", "name": str|null, "choices": [str], "temperature": float,
            "method": "token_length_normalized" | "greedy_token_selection"}
         | {"op": "fork", "id": int, "n": int, "branches": [[node, ...] * n]}
         | {"op": "join", "fork": int, "mode": "gather_variable" | "concate_and_append"}
         | {"op": "var", "name": str, "scope": str}             # append a variable's value

A scope is "" for the main stream and "f<fork id>.<branch>" inside a fork; fork ids are unique in a
program, so nested branches are named by their own fork. Results come back under "<scope>.<name>"
("name" alone in the main stream).
"""
from __future__ import annotations

import inspect
from typing import Any

from lang_client.api import _role as role_expr
from lang_client.chat_template import CHATML, ChatTemplate
from lang_client.choices import resolve_method
from lang_client.errors import NotSupportedError, TracingError
from lang_client.forks import ForkList
from lang_client.roles import RoleShortcuts
from lang_client.expr import (ArgRef, Expr, Gen, Image, RoleBegin, RoleEnd, Select, Text, VarRef,
                              to_expr, walk)

IR_VERSION = 1


def scoped_name(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


class _TraceContext:
    def __init__(self, chat_template: ChatTemplate, default_sampling: dict[str, Any]):
        self.chat_template = chat_template
        self.default_sampling = default_sampling
        self.next_fork_id = 0


class TracerState(RoleShortcuts):
    """Stands in for ProgramState while tracing: appends become IR nodes, reads become placeholders."""

    def __init__(self, ctx: _TraceContext, scope: str = "", nodes: list | None = None,
                 defined: dict[str, str] | None = None):
        self._ctx = ctx
        self.scope = scope
        self.nodes: list[dict] = nodes if nodes is not None else []
        self.defined: dict[str, str] = dict(defined or {})  # variable name -> scope that defined it
        self.defined_here: list[str] = []

    # ---- writing ----
    def __iadd__(self, other: Any) -> "TracerState":
        walk(to_expr(other), self._emit)
        return self

    def _emit(self, e: Expr) -> None:
        if isinstance(e, Text):
            if e.value:
                if self.nodes and self.nodes[-1]["op"] == "text":
                    self.nodes[-1]["text"] += e.value
                else:
                    self.nodes.append({"op": "text", "text": e.value})
        elif isinstance(e, (RoleBegin, RoleEnd)):
            begin = isinstance(e, RoleBegin)
            tmpl = self._ctx.chat_template
            self.nodes.append({"op": "role_begin" if begin else "role_end", "role": e.role,
                               "text": tmpl.prefix(e.role) if begin else tmpl.suffix(e.role)})
        elif isinstance(e, Gen):
            node = {"op": "gen", "name": e.name, "sampling_params": {**self._ctx.default_sampling, **e.sampling}}
            for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
                if getattr(e, key) is not None:
                    node[key] = getattr(e, key)
            self.nodes.append(node)
            self._defines(e.name)
        elif isinstance(e, Select):
            method = resolve_method(e.choices_method)
            if getattr(method, "name", None) is None:
                raise TracingError("a custom choices_method cannot run remotely")
            self.nodes.append({"op": "select", "name": e.name, "choices": list(e.choices),
                               "temperature": float(e.temperature), "method": method.name})
            self._defines(e.name)
        elif isinstance(e, VarRef):
            self.nodes.append({"op": "var", "name": e.name, "scope": e.scope})
        elif isinstance(e, ArgRef):
            self.nodes.append({"op": "arg", "name": e.name})
        elif isinstance(e, Image):
            raise NotSupportedError("image input is not supported by this model")
        else:
            raise TracingError(f"cannot trace {type(e).__name__}")

    def _defines(self, name: str | None) -> None:
        if name:
            self.defined[name] = self.scope
            if name not in self.defined_here:
                self.defined_here.append(name)

    def _role(self, role: str, expr: Any):
        if expr is None:
            raise TracingError("role blocks (`with s.user():`) are not traced; use s += user(...)")
        self += role_expr(role, expr)

    # ---- reading ----
    def __getitem__(self, name: str) -> VarRef:
        if name not in self.defined:
            raise TracingError(f"variable {name!r} is read before any gen or select defines it")
        return VarRef(name, self.defined[name])

    get_var = __getitem__

    def __contains__(self, name: str) -> bool:
        return name in self.defined

    def _not_traceable(self, what: str):
        raise TracingError(f"{what} needs generated values; it cannot be part of a remote program")

    def text(self):
        self._not_traceable("s.text()")

    def messages(self):
        self._not_traceable("s.messages()")

    def get_meta_info(self, name: str):
        self._not_traceable("s.get_meta_info()")

    def set_var(self, name: str, value: Any):
        self._not_traceable("s.set_var()")

    __setitem__ = set_var

    def sync(self) -> None:
        pass

    # ---- parallelism ----
    def fork(self, size: int = 1) -> "TracerGroup":
        if not isinstance(size, int) or size < 1:
            raise TracingError("fork size must be a positive integer known when tracing")
        fork_id = self._ctx.next_fork_id
        self._ctx.next_fork_id += 1
        branches: list[list[dict]] = [[] for _ in range(size)]
        self.nodes.append({"op": "fork", "id": fork_id, "n": size, "branches": branches})
        children = [TracerState(self._ctx, f"f{fork_id}.{i}", branches[i], self.defined) for i in range(size)]
        return TracerGroup(children, self, fork_id)


class TracerGroup(ForkList):
    def __init__(self, states: list[TracerState], src: TracerState, fork_id: int):
        self.states, self.src, self.fork_id = states, src, fork_id

    def join(self, mode: str = "gather_variable") -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}")
        self.src.nodes.append({"op": "join", "fork": self.fork_id, "mode": mode})
        if mode == "gather_variable":
            first = self.states[0].defined_here
            for name in first:
                if all(name in s.defined_here for s in self.states):
                    self.src._defines(name)


def trace_program(func, args: tuple, kwargs: dict, chat_template: ChatTemplate | None = None,
                  default_sampling: dict[str, Any] | None = None) -> dict:
    """Trace `func(s, *args, **kwargs)`. Parameters not given become `arg` placeholders."""
    ctx = _TraceContext(chat_template or CHATML, dict(default_sampling or {}))
    state = TracerState(ctx)
    params = list(inspect.signature(func).parameters.values())[1:]
    bound = inspect.signature(func).bind_partial(None, *args, **kwargs).arguments
    unbound: list[str] = []
    call_kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in bound:
            call_kwargs[p.name] = bound[p.name]
        elif p.default is not inspect.Parameter.empty:
            call_kwargs[p.name] = p.default
        else:
            call_kwargs[p.name] = ArgRef(p.name)
            unbound.append(p.name)
    func(state, **call_kwargs)
    return {"version": IR_VERSION, "name": getattr(func, "__name__", "program"), "args": unbound,
            "nodes": state.nodes}


def constant_prefix(ir: dict) -> str:
    """The text every run of the program starts with (what run_batch warms the cache with)."""
    out = []
    for node in ir["nodes"]:
        if node["op"] not in ("text", "role_begin", "role_end"):
            break
        out.append(node["text"])
    return "".join(out)
