"""Validation of `POST /v1/programs` bodies: lang_client's IR (version 1) checked node by node against a
closed schema and ProgramLimits, `arg` nodes bound to the request's args, every variable read resolved to
the definition it sees. The result (services/gateway/program_ir.py) is what program_exec.py runs.
"""
from __future__ import annotations

import json
import math
from typing import Any

from services.gateway.program_ir import (CHATML_ROLES, IF_TESTS, IF_TRANSFORMS, IR_VERSION, JOIN_MODES, NAME_RE, ROLES, SCOPE_RE,
                                         SELECT_METHODS, ForkNode, GenNode, IfNode, JoinNode, Program,
                                         ProgramLimits, RoleNode, SelectNode, SetNode, TextNode, VarNode)
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams

AMBIGUOUS = "ambiguous"  # a definition kind: the arms of an if defined this variable differently


def validate_program(ir: Any, limits: ProgramLimits | None = None,
                     args: dict[str, Any] | None = None) -> Program:
    """Check an IR against the schema and the limits; bind `arg` nodes to `args` (they become text).

    Raises InvalidRequest naming the offending node (param = its path) for anything malformed or over a
    limit. Variable reads must refer to a definition that comes earlier in walk order, which is also what
    makes execution free of deadlocks.
    """
    limits = limits or ProgramLimits()
    if not isinstance(ir, dict):
        raise InvalidRequest("program must be an object", "program")
    _no_extra_keys(ir, {"version", "name", "args", "nodes"}, "program")
    if ir.get("version", IR_VERSION) != IR_VERSION:
        raise InvalidRequest(f"unsupported program version {ir.get('version')!r}; expected {IR_VERSION}",
                             "program.version")
    name = ir.get("name", "program")
    if not isinstance(name, str) or len(name) > limits.max_name_chars:
        raise InvalidRequest("program.name must be a short string", "program.name")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidRequest("args must be an object", "args")
    bound: dict[str, str] = {}
    for key, value in args.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise InvalidRequest(f"argument {key!r} must be a string or a number", f"args.{key}")
        bound[key] = str(value)
    v = _Validator(limits, bound)
    v.text_chars = sum(len(k) + len(s) for k, s in bound.items())
    v.check_text_budget("args")
    nodes = v.nodes(ir.get("nodes"), "program.nodes", scope="", depth=0, role=None)[0]
    return Program(nodes, name, v.node_count, v.total_tokens)


def _no_extra_keys(d: dict, allowed: set[str], path: str) -> None:
    extra = set(d) - allowed
    if extra:
        raise InvalidRequest(f"{path}: unknown field(s) {sorted(extra)}", path)


class _Validator:
    def __init__(self, limits: ProgramLimits, args: dict[str, str]):
        self.limits = limits
        self.args = args
        self.node_count = 0
        self.if_depth = 0
        self.total_tokens = 0
        self.text_chars = 0
        self.fork_ids: dict[int, tuple[str, list[str]]] = {}  # id -> (parent scope, branch scopes)
        self.scopes = {""}
        # (scope, name) -> kind of each definition in walk order ("str" or "list" for gathered values)
        self.defs: dict[tuple[str, str], list[str]] = {}
        self.defined_in: dict[str, list[str]] = {"": []}   # scope -> names it defined itself (on every path)
        self.maybe_in: dict[str, list[str]] = {}            # scope -> names it defines on some paths only

    def check_text_budget(self, path: str) -> None:
        if self.text_chars > self.limits.max_text_chars:
            raise InvalidRequest(f"program text is over the limit of {self.limits.max_text_chars} characters",
                                 path)

    def add_text(self, s: str, path: str) -> None:
        self.text_chars += len(s)
        self.check_text_budget(path)

    def name(self, value: Any, path: str, optional: bool) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not NAME_RE.match(value) or len(value) > self.limits.max_name_chars:
            raise InvalidRequest(f"{path} must be a name (letters, digits, _ and -, at most "
                                 f"{self.limits.max_name_chars} characters)", path)
        return value

    def define(self, scope: str, name: str | None, kind: str = "str") -> None:
        if name is None:
            return
        self.defs.setdefault((scope, name), []).append(kind)
        target = self.maybe_in.setdefault(scope, []) if kind == AMBIGUOUS else self.defined_in[scope]
        if name not in target:
            target.append(name)

    def nodes(self, raw: Any, path: str, scope: str, depth: int, role: str | None,
              only: tuple[str, ...] | None = None) -> tuple[list, str | None]:
        """Validate a node list; `only`: the ops allowed in it (a set node's parts), else every op."""
        if not isinstance(raw, list):
            raise InvalidRequest(f"{path} must be a list of nodes", path)
        out = []
        for i, node in enumerate(raw):
            p = f"{path}[{i}]"
            self.node_count += 1
            if self.node_count > self.limits.max_nodes:
                raise InvalidRequest(f"program has more than {self.limits.max_nodes} nodes", p)
            if not isinstance(node, dict) or not isinstance(node.get("op"), str):
                raise InvalidRequest(f"{p} must be an object with an 'op'", p)
            if only is not None and node["op"] not in only:
                raise InvalidRequest(f"{p} must be a {', '.join(only[:-1])} or {only[-1]} node", f"{p}.op")
            handler = self.ops.get(node["op"])
            if handler is None:
                raise InvalidRequest(f"{p}: unknown op {node['op']!r}", f"{p}.op")
            if node["op"] == "if" and i != len(raw) - 1:
                raise InvalidRequest(f"{p}: an if node must be the last of its list (the rest of the stream "
                                     "belongs inside both arms)", p)
            result, role = handler(self, node, p, scope, depth, role)
            if result is not None:
                out.append(result)
        return out, role

    # one method per op; each returns (node or None, open role after it)
    def op_text(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "text"}, p)
        if not isinstance(n.get("text"), str):
            raise InvalidRequest(f"{p}.text must be a string", f"{p}.text")
        self.add_text(n["text"], p)
        return TextNode(n["text"]), role

    def op_arg(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name"}, p)
        name = self.name(n.get("name"), f"{p}.name", optional=False)
        if name not in self.args:
            raise InvalidRequest(f"{p}: argument {name!r} is not given in args", f"args.{name}")
        return TextNode(self.args[name]), role

    def _role(self, n, p, begin: bool, role):
        _no_extra_keys(n, {"op", "role", "text"}, p)
        r = n.get("role")
        if r not in ROLES:
            raise InvalidRequest(f"{p}.role must be one of {list(ROLES)}", f"{p}.role")
        text = n.get("text", CHATML_ROLES[r][0 if begin else 1])
        if not isinstance(text, str):
            raise InvalidRequest(f"{p}.text must be a string", f"{p}.text")
        self.add_text(text, p)
        if begin and role is not None:
            raise InvalidRequest(f"{p}: role {r!r} begins inside open role {role!r}", p)
        if not begin and role != r:
            raise InvalidRequest(f"{p}: role {r!r} ends but the open role is {role!r}", p)
        return RoleNode(r, begin, text), (r if begin else None)

    def op_role_begin(self, n, p, scope, depth, role):
        return self._role(n, p, True, role)

    def op_role_end(self, n, p, scope, depth, role):
        return self._role(n, p, False, role)

    def op_gen(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name", "sampling_params", "return_logprob", "logprob_start_len",
                           "top_logprobs_num"}, p)
        name = self.name(n.get("name"), f"{p}.name", optional=True)
        raw = n.get("sampling_params", {})
        try:
            params = SamplingParams.from_dict(raw, strict=True)
        except InvalidRequest as e:
            raise InvalidRequest(f"{p}.sampling_params: {e.message}", f"{p}.sampling_params.{e.param}") from None
        if params.n != 1:
            raise InvalidRequest(f"{p}: a program gen produces one value; n must be 1", f"{p}.sampling_params.n")
        for key, grammar in (("regex", params.regex), ("json_schema", params.json_schema), ("ebnf", params.ebnf)):
            if grammar:
                self.add_text(grammar, f"{p}.sampling_params.{key}")
        self.total_tokens += params.max_new_tokens
        if self.total_tokens > self.limits.max_total_tokens:
            raise InvalidRequest(f"program asks for more than {self.limits.max_total_tokens} tokens in total "
                                 "(max_new_tokens summed over every gen)", f"{p}.sampling_params.max_new_tokens")
        logprob = {}
        if n.get("return_logprob") is not None:
            if not isinstance(n["return_logprob"], bool):
                raise InvalidRequest(f"{p}.return_logprob must be a boolean", f"{p}.return_logprob")
            logprob["return_logprob"] = n["return_logprob"]
        for key in ("logprob_start_len", "top_logprobs_num"):
            if n.get(key) is not None:
                if isinstance(n[key], bool) or not isinstance(n[key], int) or n[key] < -1 or n[key] > 1_000_000:
                    raise InvalidRequest(f"{p}.{key} must be an integer", f"{p}.{key}")
                logprob[key] = n[key]
        self.define(scope, name)
        return GenNode(name, dict(raw), logprob), role

    def op_select(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name", "choices", "temperature", "method"}, p)
        name = self.name(n.get("name"), f"{p}.name", optional=True)
        choices = n.get("choices")
        if (not isinstance(choices, list) or not choices or len(choices) > self.limits.max_choices
                or not all(isinstance(c, str) for c in choices)):
            raise InvalidRequest(f"{p}.choices must be 1 to {self.limits.max_choices} strings", f"{p}.choices")
        for c in choices:
            self.add_text(c, f"{p}.choices")
        temperature = n.get("temperature", 0.0)
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not math.isfinite(temperature) or temperature < 0):
            raise InvalidRequest(f"{p}.temperature must be a number >= 0", f"{p}.temperature")
        method = n.get("method", SELECT_METHODS[0])
        if method not in SELECT_METHODS:
            raise InvalidRequest(f"{p}.method must be one of {list(SELECT_METHODS)}", f"{p}.method")
        self.define(scope, name)
        return SelectNode(name, list(choices), float(temperature), method), role

    def op_fork(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "id", "n", "branches"}, p)
        fid, width, branches = n.get("id"), n.get("n"), n.get("branches")
        if isinstance(fid, bool) or not isinstance(fid, int) or fid < 0 or fid in self.fork_ids:
            raise InvalidRequest(f"{p}.id must be an integer unique in the program", f"{p}.id")
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= self.limits.max_fork_width:
            raise InvalidRequest(f"{p}.n must be between 1 and {self.limits.max_fork_width}", f"{p}.n")
        if not isinstance(branches, list) or len(branches) != width:
            raise InvalidRequest(f"{p}.branches must hold n={width} node lists", f"{p}.branches")
        if depth + 1 > self.limits.max_depth:
            raise InvalidRequest(f"forks nest deeper than {self.limits.max_depth}", p)
        scopes = [f"f{fid}.{i}" for i in range(width)]
        self.fork_ids[fid] = (scope, scopes)
        out = []
        for i, (branch, bscope) in enumerate(zip(branches, scopes)):
            self.scopes.add(bscope)
            self.defined_in[bscope] = []
            nodes, _ = self.nodes(branch, f"{p}.branches[{i}]", bscope, depth + 1, role)
            out.append(nodes)
        return ForkNode(fid, out), role

    def op_join(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "fork", "mode"}, p)
        fid, mode = n.get("fork"), n.get("mode", JOIN_MODES[0])
        if fid not in self.fork_ids or self.fork_ids[fid][0] != scope:
            raise InvalidRequest(f"{p}.fork must name an earlier fork of this stream", f"{p}.fork")
        if mode not in JOIN_MODES:
            raise InvalidRequest(f"{p}.mode must be one of {list(JOIN_MODES)}", f"{p}.mode")
        names, maybe = [], []
        if mode == "gather_variable":
            branches = self.fork_ids[fid][1]
            names = gathered(self.defined_in, branches)
            possible = {b: self.defined_in[b] + self.maybe_in.get(b, []) for b in branches}
            maybe = [name for name in gathered(possible, branches) if name not in names]
            for name in names:
                self.define(scope, name, kind="list")
            for name in maybe:  # gathered only when every branch's path defined it, as the interpreter does
                self.define(scope, name, kind=AMBIGUOUS)
        return JoinNode(fid, mode, names, maybe), role

    def read(self, name_raw: Any, scope_raw: Any, p: str, what: str) -> tuple[str, str, int]:
        """A read of (scope, name) sees its latest definition so far in walk order: (name, scope, index)."""
        name = self.name(name_raw, f"{p}.name" if what == "var" else f"{p}.cond.var", optional=False)
        vscope = "" if scope_raw is None else scope_raw
        if not isinstance(vscope, str) or not SCOPE_RE.match(vscope) or vscope not in self.scopes:
            raise InvalidRequest(f"{p}.scope must name the main stream or an earlier fork branch", f"{p}.scope")
        kinds = self.defs.get((vscope, name))
        if not kinds:
            raise InvalidRequest(f"{p}: variable {name!r} is read before it is defined", f"{p}.name")
        if AMBIGUOUS in kinds:
            raise InvalidRequest(f"{p}: variable {name!r} is defined under a condition in another stream, so "
                                 "which value a read sees depends on the path; read it in its own stream", f"{p}.name")
        if kinds[-1] != "str":
            holds = "a gathered list" if kinds[-1] == "list" else "a value that is not a string"
            raise InvalidRequest(f"{p}: variable {name!r} holds {holds} and cannot be {what}", f"{p}.name")
        return name, vscope, len(kinds) - 1

    def op_var(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name", "scope"}, p)
        name, vscope, index = self.read(n.get("name"), n.get("scope", ""), p, "appended as text")
        return VarNode(name, vscope, index), role

    def op_set(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name", "value", "parts"}, p)
        name = self.name(n.get("name"), f"{p}.name", optional=False)
        if ("value" in n) == ("parts" in n):
            raise InvalidRequest(f"{p} must have either a value or parts", p)
        if "parts" in n:
            parts, _ = self.nodes(n["parts"], f"{p}.parts", scope, depth, role, only=("text", "var", "arg"))
            self.define(scope, name)  # after its parts: `x = x + "!"` reads the previous x
            return SetNode(name, parts), role
        value = n["value"]
        try:
            encoded = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{p}.value must be JSON data", f"{p}.value") from None
        self.add_text(encoded, f"{p}.value")
        self.define(scope, name, "str" if isinstance(value, str) else "data")
        return SetNode(name, None, value), role

    def op_if(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "cond", "then", "else"}, p)
        cond = n.get("cond")
        if not isinstance(cond, dict):
            raise InvalidRequest(f"{p}.cond must be an object", f"{p}.cond")
        _no_extra_keys(cond, {"var", "scope", "test", "value", "transforms"}, f"{p}.cond")
        transforms = cond.get("transforms", [])
        if (not isinstance(transforms, list) or len(transforms) > 8
                or not all(isinstance(t, str) and t in IF_TRANSFORMS for t in transforms)):
            raise InvalidRequest(f"{p}.cond.transforms must be a list of at most 8 of {sorted(IF_TRANSFORMS)}",
                                 f"{p}.cond.transforms")
        name, vscope, index = self.read(cond.get("var"), cond.get("scope", ""), f"{p}.cond", "compared")
        test, value = cond.get("test"), cond.get("value")
        if test not in IF_TESTS:
            raise InvalidRequest(f"{p}.cond.test must be one of {list(IF_TESTS)}", f"{p}.cond.test")
        if not isinstance(value, str):
            raise InvalidRequest(f"{p}.cond.value must be a string", f"{p}.cond.value")
        self.add_text(value, f"{p}.cond.value")
        self.if_depth += 1
        if self.if_depth > self.limits.max_if_depth:
            raise InvalidRequest(f"if nodes nest deeper than {self.limits.max_if_depth}", p)
        before = self.snapshot()
        then, role_then = self.nodes(n.get("then"), f"{p}.then", scope, depth, role)
        after_then = self.snapshot()
        self.restore(before)
        orelse, _ = self.nodes(n.get("else"), f"{p}.else", scope, depth, role)
        self.merge(after_then)
        self.if_depth -= 1
        return IfNode(name, vscope, index, test, value, then, orelse, list(transforms)), role_then

    # Definitions made in an if's arms: each arm is walked from the same state; afterwards a definition
    # both arms made alike stays, one they made differently is AMBIGUOUS to readers in other streams.
    def snapshot(self) -> tuple[dict, dict, dict]:
        return tuple({k: list(v) for k, v in d.items()} for d in (self.defs, self.defined_in, self.maybe_in))

    def restore(self, snap: tuple[dict, dict, dict]) -> None:
        self.defs, self.defined_in, self.maybe_in = ({k: list(v) for k, v in d.items()} for d in snap)

    def merge(self, other: tuple[dict, dict, dict]) -> None:
        defs, defined_in, maybe_in = other
        for scope in set(maybe_in) | set(self.maybe_in):
            mine = self.maybe_in.setdefault(scope, [])
            mine.extend(name for name in maybe_in.get(scope, []) if name not in mine)
        for key in set(defs) | set(self.defs):
            mine, theirs = self.defs.get(key), defs.get(key)
            if mine != theirs:
                self.defs[key] = (mine or theirs or []) + [AMBIGUOUS]
        for scope in set(defined_in) | set(self.defined_in):
            mine, theirs = self.defined_in.get(scope), defined_in.get(scope)
            if mine is None or theirs is None:
                self.defined_in[scope] = mine if mine is not None else theirs
            else:
                self.defined_in[scope] = [name for name in mine if name in theirs]
                maybe = self.maybe_in.setdefault(scope, [])
                maybe.extend(n for n in mine + theirs if n not in self.defined_in[scope] and n not in maybe)

    ops = {"text": op_text, "arg": op_arg, "role_begin": op_role_begin, "role_end": op_role_end,
           "gen": op_gen, "select": op_select, "fork": op_fork, "join": op_join, "var": op_var, "if": op_if,
           "set": op_set}


def gathered(defined_in: dict[str, list[str]], branch_scopes: list[str]) -> list[str]:
    """Names every branch of a fork defined itself: join(gather_variable) turns each into a list."""
    first = defined_in[branch_scopes[0]]
    return [name for name in first if all(name in defined_in[s] for s in branch_scopes)]


def parse_program_request(body: Any, limits: ProgramLimits | None = None) -> tuple[Program, bool]:
    """Body of POST /v1/programs -> (validated program, stream?)."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be an object")
    _no_extra_keys(body, {"program", "args", "stream"}, "body")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", "stream")
    return validate_program(body.get("program"), limits, body.get("args")), stream
