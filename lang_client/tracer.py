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
         | {"op": "set", "name": str, "value": JSON data}       # s.set_var(name, constant)
         | {"op": "set", "name": str, "parts": [text | var | arg node, ...]}   # ... a string built from
                                                               # generated values: the parts joined
         | {"op": "if", "cond": {"var": str, "scope": str, "test": "eq" | "ne", "value": str},
            "then": [node, ...], "else": [node, ...]}           # always the last node of its list

A scope is "" for the main stream and "f<fork id>.<branch>" inside a fork; fork ids are unique in a
program, so nested branches are named by their own fork. Results come back under "<scope>.<name>"
("name" alone in the main stream).

String work on generated values (`+` either way, `str.join`, f-strings, `%`, `str()`) works because a
variable read while tracing is a str holding a marker (lang_client.expr.VarRef); appended text is split at
the markers into `text` and `var` nodes. A comparison of a variable with a constant is a branch: the
program is run once per outcome (a select's choices bound the outcomes) and the runs are merged into `if`
nodes placed where the streams' node lists first differ.
"""
from __future__ import annotations

import inspect
from typing import Any

from lang_client.api import _role as role_expr
from lang_client.chat_template import CHATML, ChatTemplate
from lang_client.choices import resolve_method
from lang_client.errors import NotSupportedError, TracingError
from lang_client.expr import (MARK_CLOSE, MARK_OPEN, MARKER_RE, ArgRef, Expr, Gen, Image, Placeholder, RoleBegin,
                              RoleEnd, Select, Text, VarRef, to_expr, user_line, walk)
from lang_client.forks import ForkList
from lang_client.roles import RoleShortcuts
from lang_client.trace_rewrite import instrument
from lang_client.wire import IR_VERSION, apply_transforms

MAX_PATHS = 64           # runs of the Python function for one trace (outcomes of all branches)
MAX_DECISIONS = 64       # branches on one path: past this it is a loop that only a generated value ends


class _Trace:
    """Shared by every run of one trace."""

    def __init__(self, chat_template: ChatTemplate, default_sampling: dict[str, Any]):
        self.chat_template = chat_template
        self.default_sampling = default_sampling
        self.fork_ids: dict[tuple, int] = {}  # (decisions so far, nth fork since) -> program-wide id
        self.runs = 0
        self.lines: list[str] = []            # where branches were taken (for error messages)


class _Run:
    """One run of the function along a forced prefix of branch outcomes (later branches take True)."""

    def __init__(self, trace: _Trace, forced: list[bool]):
        self.trace = trace
        self.forced = forced
        self.decisions: list[bool] = []
        self.snapshots: list[dict[str, int]] = []   # per decision: every node list's length, by scope
        self.conds: list[dict] = []
        self.lists: dict[str, list] = {}
        self.markers: list[Placeholder] = []
        self.def_counts: dict[tuple[str, str], int] = {}
        self.facts: dict[tuple, tuple[str, Any]] = {}  # variable definition -> what the branches taken imply
        self.line_counts: dict[str, int] = {}
        self.forks_since_decision = 0

    # ---- placeholders ----
    def var(self, name: str, scope: str, choices: list[str] | None, transforms: tuple[str, ...] = ()) -> VarRef:
        key = (scope, name, self.def_counts.get((scope, name), 0), transforms)
        ref = VarRef(len(self.markers), name=name, scope=scope, key=key, choices=choices, transforms=transforms,
                     tracer_hook=self.branch, derive=self.derive)
        self.markers.append(ref)
        if key not in self.facts:
            if choices is not None:
                self.facts[key] = ("in", frozenset(apply_transforms(c, transforms) for c in choices))
            else:
                self.facts[key] = ("not", frozenset())
        return ref

    def derive(self, ref: VarRef, method: str) -> VarRef:
        """`ref.strip()` and the like: the same variable, to be transformed before a comparison."""
        key = (*ref.key[:3], ref.transforms + (method,))
        derived = VarRef(len(self.markers), name=ref.name, scope=ref.scope, key=key, choices=ref.choices,
                         transforms=ref.transforms + (method,), tracer_hook=self.branch, derive=self.derive)
        self.markers.append(derived)
        if key not in self.facts:
            self.facts[key] = (("in", frozenset(apply_transforms(c, derived.transforms) for c in ref.choices))
                               if ref.choices is not None else ("not", frozenset()))
        return derived

    def arg(self, name: str) -> ArgRef:
        ref = ArgRef(len(self.markers), name=name)
        self.markers.append(ref)
        return ref

    def decode(self, text: str) -> list[dict]:
        """Split appended text at the markers into text / var / arg nodes."""
        text = str(text)
        if MARK_OPEN not in text and MARK_CLOSE not in text:
            return [{"op": "text", "text": text}] if text else []
        out = []
        parts = MARKER_RE.split(text)
        for i, part in enumerate(parts):
            if i % 2 == 0:
                if MARK_OPEN in part or MARK_CLOSE in part:
                    raise TracingError("a generated value or unbound argument was cut apart (sliced, split or "
                                       "stripped) while tracing; a remote program can only concatenate, join "
                                       "and format them whole")
                if part:
                    out.append({"op": "text", "text": part})
                continue
            ref = self.markers[int(part)] if int(part) < len(self.markers) else None
            if isinstance(ref, VarRef) and ref.transforms:
                raise TracingError(f"variable {ref.name!r} with .{'().'.join(ref.transforms)}() can be compared "
                                   "with constants in a remote program, not appended; append the variable itself")
            if isinstance(ref, VarRef):
                out.append({"op": "var", "name": ref.name, "scope": ref.scope})
            elif isinstance(ref, ArgRef):
                out.append({"op": "arg", "name": ref.name})
            else:
                raise TracingError("a placeholder from another run of the program was appended")
        return out

    # ---- branches ----
    def branch(self, ref: VarRef, test: str, value: Any) -> bool:
        if isinstance(value, Placeholder):
            raise TracingError(f"comparing variable {ref.name!r} with another generated value while tracing: "
                               "a remote program can only compare a variable with a constant")
        if not isinstance(value, str):
            return test == "ne"  # a generated value is a str: it never equals a number or None
        kind, values = self.facts[ref.key]
        if kind == "is":
            eq = values == value
            return eq if test == "eq" else not eq
        can_eq = value in values if kind == "in" else value not in values
        can_ne = (bool(values - {value}) if kind == "in" else True)
        if not (can_eq and can_ne):
            return can_eq if test == "eq" else not can_eq
        line = user_line()
        self.line_counts[line] = self.line_counts.get(line, 0) + 1
        if len(self.decisions) >= MAX_DECISIONS:
            worst = max(self.line_counts, key=self.line_counts.get)
            raise TracingError(f"{worst}: this comparison ran {self.line_counts[worst]} times on one path: a loop "
                               "that runs until a generated value says so cannot be compiled into a remote "
                               "program; run it without remote=True (interpreter mode)")
        if line not in self.trace.lines:
            self.trace.lines.append(line)
        k = len(self.decisions)
        outcome = self.forced[k] if k < len(self.forced) else True
        self.decisions.append(outcome)
        self.snapshots.append({scope: len(nodes) for scope, nodes in self.lists.items()})
        cond = {"var": ref.name, "scope": ref.scope, "test": test, "value": value}
        if ref.transforms:
            cond["transforms"] = list(ref.transforms)
        self.conds.append(cond)
        self.forks_since_decision = 0
        equal = outcome if test == "eq" else not outcome
        self.facts[ref.key] = ("is", value) if equal else (
            (kind, values - {value}) if kind == "in" else (kind, values | {value}))
        if self.facts[ref.key][0] == "in" and len(self.facts[ref.key][1]) == 1:
            self.facts[ref.key] = ("is", next(iter(self.facts[ref.key][1])))
        return outcome

    def fork_id(self) -> int:
        key = (tuple(self.decisions), self.forks_since_decision)
        self.forks_since_decision += 1
        return self.trace.fork_ids.setdefault(key, len(self.trace.fork_ids))


class TracerState(RoleShortcuts):
    """Stands in for ProgramState while tracing: appends become IR nodes, reads become placeholders."""

    def __init__(self, run: _Run, scope: str = "", nodes: list | None = None,
                 defined: dict[str, Any] | None = None):
        self._run = run
        self.scope = scope
        self.nodes: list[dict] = nodes if nodes is not None else []
        run.lists[scope] = self.nodes
        # variable name -> (scope that defined it, select choices or None) | ("list", gathered values)
        self.defined: dict[str, Any] = dict(defined or {})
        self.defined_here: list[str] = []

    # ---- writing ----
    def __iadd__(self, other: Any) -> "TracerState":
        walk(to_expr(other), self._emit)
        return self

    def _emit(self, e: Expr) -> None:
        if isinstance(e, Text):
            self.nodes.extend(self._run.decode(e.value))
        elif isinstance(e, (RoleBegin, RoleEnd)):
            begin = isinstance(e, RoleBegin)
            tmpl = self._run.trace.chat_template
            self.nodes.append({"op": "role_begin" if begin else "role_end", "role": e.role,
                               "text": tmpl.prefix(e.role) if begin else tmpl.suffix(e.role)})
        elif isinstance(e, Gen):
            sampling = {**self._run.trace.default_sampling, **e.sampling}
            _no_markers(sampling, "gen's sampling parameters")
            node = {"op": "gen", "name": e.name, "sampling_params": sampling}
            for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
                if getattr(e, key) is not None:
                    node[key] = getattr(e, key)
            self.nodes.append(node)
            self._defines(e.name, (self.scope, None))
        elif isinstance(e, Select):
            method = resolve_method(e.choices_method)
            if getattr(method, "name", None) is None:
                raise TracingError("a custom choices_method cannot run remotely")
            _no_markers(e.choices, "select's choices")
            self.nodes.append({"op": "select", "name": e.name, "choices": [str(c) for c in e.choices],
                               "temperature": float(e.temperature), "method": method.name})
            self._defines(e.name, (self.scope, list(e.choices)))
        elif isinstance(e, Image):
            raise NotSupportedError("image input is not supported by this model (text-only); "
                                    "remove image() from the program")
        else:
            raise TracingError(f"cannot trace {type(e).__name__}")

    def _defines(self, name: str | None, how: Any) -> None:
        if name:
            self.defined[name] = how
            key = (self.scope, name)
            self._run.def_counts[key] = self._run.def_counts.get(key, 0) + 1
            if name not in self.defined_here:
                self.defined_here.append(name)

    def _role(self, role: str, expr: Any):
        if expr is None:
            raise TracingError("role blocks (`with s.user():`) are not traced; use s += user(...)")
        self += role_expr(role, expr)

    # ---- reading ----
    def __getitem__(self, name: str):
        if name not in self.defined:
            raise TracingError(f"variable {name!r} is read before any gen or select defines it")
        how = self.defined[name]
        if how[0] == "list":
            return list(how[1])
        if how[0] == "const":  # set_var with a constant: Python may use it like the interpreter does
            return how[1]
        scope, choices = how
        # A read sees the latest definition: counted as of now (the reader may be another stream).
        return self._run.var(name, scope, choices)

    get_var = __getitem__

    def __contains__(self, name: str) -> bool:
        return name in self.defined

    def _not_traceable(self, what: str):
        raise TracingError(f"{what} needs generated values; it cannot be part of a remote program "
                           "(run it without remote=True)")

    def text(self):
        self._not_traceable("s.text()")

    def messages(self):
        self._not_traceable("s.messages()")

    def get_meta_info(self, name: str):
        self._not_traceable("s.get_meta_info()")

    def set_var(self, name: str, value: Any) -> None:
        """`s.set_var(name, value)` / `s[name] = value` as IR data: a `set` node with a constant, or with
        the text / var / arg nodes of a string built from generated values (the server joins them)."""
        if not isinstance(name, str) or type(name) is not str or not name:
            raise TracingError(f"s.set_var(): the variable name must be a non-empty constant string, "
                               f"not {type(name).__name__}")
        if isinstance(value, str):
            if isinstance(value, VarRef) and value.transforms:
                raise TracingError(f"s.set_var({name!r}, ...): variable {value.name!r} with "
                                   f".{'().'.join(value.transforms)}() cannot be stored in a remote program; "
                                   "store the variable itself")
            parts = self._run.decode(value)
            if all(p["op"] == "text" for p in parts):
                text = "".join(p["text"] for p in parts)
                self.nodes.append({"op": "set", "name": name, "value": text})
                self._defines(name, ("const", text))
            else:
                self.nodes.append({"op": "set", "name": name, "parts": parts})
                # `s["y"] = s["x"]` keeps what the tracer knows of x's values (a select's choices).
                choices = value.choices if isinstance(value, VarRef) else None
                self._defines(name, (self.scope, choices))
            return
        self.nodes.append({"op": "set", "name": name, "value": _json_constant(value, name)})
        self._defines(name, ("const", value))

    __setitem__ = set_var

    def sync(self) -> None:
        pass

    # ---- parallelism ----
    def fork(self, size: int = 1) -> "TracerGroup":
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise TracingError("fork size must be a positive integer known when tracing")
        fork_id = self._run.fork_id()
        branches: list[list[dict]] = [[] for _ in range(size)]
        self.nodes.append({"op": "fork", "id": fork_id, "n": size, "branches": branches})
        children = [TracerState(self._run, f"f{fork_id}.{i}", branches[i], self.defined) for i in range(size)]
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
                    self.src._defines(name, ("list", [s[name] for s in self.states]))


def _json_constant(value: Any, name: str) -> Any:
    """A set_var value that is not a string: JSON data (None, bool, finite numbers, lists and str-keyed
    dicts of them), which the server stores and answers as it is; anything else is refused."""
    def check(v: Any) -> None:
        if v is None or isinstance(v, (bool, int)):
            return
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise TracingError(f"s.set_var({name!r}, ...): {v} is not a finite number")
            return
        if isinstance(v, str):
            _no_markers(v, f"s.set_var({name!r}, ...) inside a list or dict")
            return
        if type(v) is list:
            for item in v:
                check(item)
            return
        if type(v) is dict:
            for k, item in v.items():
                if not isinstance(k, str):
                    raise TracingError(f"s.set_var({name!r}, ...): dict keys must be strings in a remote program")
                _no_markers(k, f"s.set_var({name!r}, ...) dict keys")
                check(item)
            return
        raise TracingError(f"s.set_var({name!r}, ...): a {type(v).__name__} cannot be part of a remote program; "
                           "a variable may hold a string (constant or built from generated values) or JSON data "
                           "(numbers, booleans, None, lists and dicts of them); run the program without "
                           "remote=True to store other objects")
    check(value)
    return value


def _no_markers(value: Any, what: str) -> None:
    if isinstance(value, str):
        value = str(value)
        if MARK_OPEN in value or MARK_CLOSE in value:
            raise TracingError(f"{what} cannot depend on generated values or unbound arguments in a remote program")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _no_markers(v, what)
    elif isinstance(value, dict):
        for v in value.values():
            _no_markers(v, what)


# ---- path exploration ----
def _run_once(trace: _Trace, func, call_kwargs: dict[str, Any], forced: list[bool]) -> _Run:
    trace.runs += 1
    if trace.runs > MAX_PATHS:
        raise TracingError(f"the program has more than {MAX_PATHS} paths through its branches (at "
                           f"{', '.join(trace.lines)}); a remote program must have fewer: run it without "
                           "remote=True, or branch less")
    run = _Run(trace, forced)
    state = TracerState(run)
    kwargs = {k: (run.arg(k) if isinstance(v, ArgRef) else v) for k, v in call_kwargs.items()}
    func(state, **kwargs)
    return run


def _explore(trace: _Trace, func, call_kwargs, forced: list[bool], run: _Run | None = None) -> list[dict]:
    """The root node list of every path that starts with `forced`, merged into `if` nodes."""
    run = run or _run_once(trace, func, call_kwargs, forced)
    k = len(forced)
    if len(run.decisions) <= k:
        return run.lists[""]
    taken = run.decisions[k]
    mine = _explore(trace, func, call_kwargs, forced + [taken], run)
    other = _explore(trace, func, call_kwargs, forced + [not taken])
    then, orelse = (mine, other) if taken else (other, mine)
    return _merge_list(then, orelse, "", run.snapshots[k], run.conds[k])


def _merge_list(a: list, b: list, scope: str, snapshot: dict[str, int], cond: dict) -> list:
    n = snapshot[scope]
    out = [_merge_node(x, y, snapshot, cond) for x, y in zip(a[:n], b[:n])]
    if a[n:] == b[n:]:
        out.extend(a[n:])
    else:
        out.append({"op": "if", "cond": dict(cond), "then": a[n:], "else": b[n:]})
    return out


def _merge_node(x: dict, y: dict, snapshot: dict[str, int], cond: dict) -> dict:
    if x["op"] == "fork":  # it existed before the branch: its branches may have grown differently since
        branches = [_merge_list(bx, by, f"f{x['id']}.{i}", snapshot, cond)
                    for i, (bx, by) in enumerate(zip(x["branches"], y["branches"]))]
        return {**x, "branches": branches}
    return x


def _coalesce(nodes: list[dict]) -> list[dict]:
    """Adjacent text nodes become one; recursively through forks and branches."""
    out: list[dict] = []
    for node in nodes:
        if node["op"] == "text" and out and out[-1]["op"] == "text":
            out[-1] = {"op": "text", "text": out[-1]["text"] + node["text"]}
            continue
        if node["op"] == "fork":
            node = {**node, "branches": [_coalesce(b) for b in node["branches"]]}
        elif node["op"] == "if":
            node = {**node, "then": _coalesce(node["then"]), "else": _coalesce(node["else"])}
        out.append(node)
    return out


def trace_program(func, args: tuple, kwargs: dict, chat_template: ChatTemplate | None = None,
                  default_sampling: dict[str, Any] | None = None) -> dict:
    """Trace `func(s, *args, **kwargs)`. Parameters not given become `arg` placeholders."""
    trace = _Trace(chat_template or CHATML, dict(default_sampling or {}))
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
            call_kwargs[p.name] = ArgRef(-1, name=p.name)  # replaced by a per-run placeholder
            unbound.append(p.name)
    # Strings the program builds from generated values stay TracedStr (lang_client/trace_rewrite.py).
    nodes = _coalesce(_explore(trace, instrument(func), call_kwargs, []))
    return {"version": IR_VERSION, "name": getattr(func, "__name__", "program"), "args": unbound,
            "nodes": nodes}


def constant_prefix(ir: dict) -> str:
    """The text every run of the program starts with (what run_batch warms the cache with)."""
    out = []
    for node in ir["nodes"]:
        if node["op"] not in ("text", "role_begin", "role_end"):
            break
        out.append(node["text"])
    return "".join(out)
