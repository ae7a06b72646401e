"""Validation of `POST /v1/programs` programs: lang_client's IR (version 1) decoded into its typed ops
(ir.py: the closed schema), then checked against ProgramLimits, `arg` nodes bound to the request's
args, every variable read resolved to the definition it sees. The result (ir.py's Program: the same ops,
args bound, and side tables) is what execute.py runs.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from lang_client.chat_template import CHATML
from msgspec.structs import replace

from services.gateway.programs.ir import (IR_VERSION, ArgOp, ForkOp, GenOp, IfOp, JoinOp, Program, ProgramIR,
                                         ProgramLimits, ProgramRequest, RoleBeginOp, RoleEndOp, SelectOp, SetOp,
                                         TextOp, VarOp)
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams

AMBIGUOUS = "ambiguous"  # a definition kind: the arms of an if defined this variable differently


def validate_program(ir: Any, limits: ProgramLimits | None = None,
                     args: dict[str, Any] | None = None) -> Program:
    """Check an IR (a ProgramIR, or its JSON data) against the limits and bind `arg` nodes to `args`;
    InvalidRequest names the offending node's path. A read must see a definition earlier in walk order,
    which is also what keeps execution free of deadlocks."""
    limits = limits or ProgramLimits()
    if not isinstance(ir, ProgramIR):
        ir = _decoded({"program": ir}).program
    if ir.version != IR_VERSION:
        raise InvalidRequest(f"unsupported program version {ir.version!r}; expected {IR_VERSION}", "program.version")
    bound = {key: str(value) for key, value in (args or {}).items()}  # typed by ProgramRequest
    v = _Validator(limits, bound)
    v.text_chars = sum(len(k) + len(s) for k, s in bound.items())
    v.check_text_budget("args")
    nodes = v.nodes(ir.nodes, "program.nodes", scope="", depth=0, role=None)[0]
    return Program(nodes, v.reads, v.joins)


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
        self.reads: dict[int, int] = {}                     # Program's side tables, keyed by id(op)
        self.joins: dict[int, tuple[list[str], list[str]]] = {}

    def keyed(self, table: dict, op: Any, value: Any) -> Any:
        """`op` entered in a side table; a copy if it is entered already (an op object used twice)."""
        if id(op) in self.reads or id(op) in self.joins:
            op = replace(op)
        table[id(op)] = value
        return op

    def check_text_budget(self, path: str) -> None:
        if self.text_chars > self.limits.max_text_chars:
            raise InvalidRequest(f"program text is over the limit of {self.limits.max_text_chars} characters",
                                 path)

    def add_text(self, s: str, path: str) -> None:
        self.text_chars += len(s)
        self.check_text_budget(path)

    def define(self, scope: str, name: str | None, kind: str = "str") -> None:
        if name is None:
            return
        self.defs.setdefault((scope, name), []).append(kind)
        target = self.maybe_in.setdefault(scope, []) if kind == AMBIGUOUS else self.defined_in[scope]
        if name not in target:
            target.append(name)

    def nodes(self, ops: list, path: str, scope: str, depth: int, role: str | None) -> tuple[list, str | None]:
        out = []
        for i, node in enumerate(ops):
            p = f"{path}[{i}]"
            self.node_count += 1
            if self.node_count > self.limits.max_nodes:
                raise InvalidRequest(f"program has more than {self.limits.max_nodes} nodes", p)
            if isinstance(node, IfOp) and i != len(ops) - 1:
                raise InvalidRequest(f"{p}: an if node must be the last of its list (the rest of the stream "
                                     "belongs inside both arms)", p)
            result, role = self.ops[type(node)](self, node, p, scope, depth, role)
            out.append(result)
        return out, role

    # one method per op; each returns (the op as execute.py runs it, open role after it)
    def op_text(self, n: TextOp, p, scope, depth, role):
        self.add_text(n.text, p)
        return n, role

    def op_arg(self, n: ArgOp, p, scope, depth, role):
        if n.name not in self.args:
            raise InvalidRequest(f"{p}: argument {n.name!r} is not given in args", f"args.{n.name}")
        return TextOp(text=self.args[n.name]), role

    def op_role(self, n: RoleBeginOp | RoleEndOp, p, scope, depth, role):
        begin = isinstance(n, RoleBeginOp)
        text = (CHATML.prefix if begin else CHATML.suffix)(n.role) if n.text is None else n.text
        self.add_text(text, p)
        if begin and role is not None:
            raise InvalidRequest(f"{p}: role {n.role!r} begins inside open role {role!r}", p)
        if not begin and role != n.role:
            raise InvalidRequest(f"{p}: role {n.role!r} ends but the open role is {role!r}", p)
        return (n if n.text is not None else replace(n, text=text)), (n.role if begin else None)

    def op_gen(self, n: GenOp, p, scope, depth, role):
        try:
            params = SamplingParams.from_dict(n.sampling_params, strict=True)
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
        self.define(scope, n.name)
        return n, role

    def op_select(self, n: SelectOp, p, scope, depth, role):
        for c in n.choices:
            self.add_text(c, f"{p}.choices")
        self.define(scope, n.name)
        return n, role

    def op_fork(self, n: ForkOp, p, scope, depth, role):
        if n.id in self.fork_ids:
            raise InvalidRequest(f"{p}.id must be an integer unique in the program", f"{p}.id")
        if len(n.branches) != n.n:
            raise InvalidRequest(f"{p}.branches must hold n={n.n} node lists", f"{p}.branches")
        if depth + 1 > self.limits.max_depth:
            raise InvalidRequest(f"forks nest deeper than {self.limits.max_depth}", p)
        scopes = [f"f{n.id}.{i}" for i in range(n.n)]
        self.fork_ids[n.id] = (scope, scopes)
        out = []
        for i, (branch, bscope) in enumerate(zip(n.branches, scopes)):
            self.scopes.add(bscope)
            self.defined_in[bscope] = []
            out.append(self.nodes(branch, f"{p}.branches[{i}]", bscope, depth + 1, role)[0])
        return replace(n, branches=out), role

    def op_join(self, n: JoinOp, p, scope, depth, role):
        if n.fork not in self.fork_ids or self.fork_ids[n.fork][0] != scope:
            raise InvalidRequest(f"{p}.fork must name an earlier fork of this stream", f"{p}.fork")
        names, maybe = [], []
        if n.mode == "gather_variable":
            branches = self.fork_ids[n.fork][1]
            names = gathered(self.defined_in, branches)
            possible = {b: self.defined_in[b] + self.maybe_in.get(b, []) for b in branches}
            maybe = [name for name in gathered(possible, branches) if name not in names]
            for name in names:
                self.define(scope, name, kind="list")
            for name in maybe:  # gathered only when every branch's path defined it, as the interpreter does
                self.define(scope, name, kind=AMBIGUOUS)
        return self.keyed(self.joins, n, (names, maybe)), role

    def read(self, name: str, vscope: str, p: str, what: str) -> int:
        """A read of (scope, name) sees its latest definition so far in walk order: its index."""
        if vscope not in self.scopes:
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
        return len(kinds) - 1

    def op_var(self, n: VarOp, p, scope, depth, role):
        return self.keyed(self.reads, n, self.read(n.name, n.scope, p, "appended as text")), role

    def op_set(self, n: SetOp, p, scope, depth, role):
        if (n.value is msgspec.UNSET) == (n.parts is msgspec.UNSET):
            raise InvalidRequest(f"{p} must have either a value or parts", p)
        if n.parts is not msgspec.UNSET:
            parts, _ = self.nodes(n.parts, f"{p}.parts", scope, depth, role)
            self.define(scope, n.name)  # after its parts: `x = x + "!"` reads the previous x
            return replace(n, parts=parts), role
        try:
            encoded = json.dumps(n.value, allow_nan=False)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{p}.value must be JSON data", f"{p}.value") from None
        self.add_text(encoded, f"{p}.value")
        self.define(scope, n.name, "str" if isinstance(n.value, str) else "data")
        return n, role

    def op_if(self, n: IfOp, p, scope, depth, role):
        cond = n.cond
        index = self.read(cond.var, cond.scope, f"{p}.cond", "compared")
        self.add_text(cond.value, f"{p}.cond.value")
        self.if_depth += 1
        if self.if_depth > self.limits.max_if_depth:
            raise InvalidRequest(f"if nodes nest deeper than {self.limits.max_if_depth}", p)
        before = self.snapshot()
        then, role_then = self.nodes(n.then, f"{p}.then", scope, depth, role)
        after_then = self.snapshot()
        self.restore(before)
        orelse, _ = self.nodes(n.orelse, f"{p}.else", scope, depth, role)
        self.merge(after_then)
        self.if_depth -= 1
        return self.keyed(self.reads, replace(n, then=then, orelse=orelse), index), role_then

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

    ops = {TextOp: op_text, ArgOp: op_arg, RoleBeginOp: op_role, RoleEndOp: op_role, GenOp: op_gen,
           SelectOp: op_select, ForkOp: op_fork, JoinOp: op_join, VarOp: op_var, IfOp: op_if, SetOp: op_set}


def gathered(defined_in: dict[str, list[str]], branch_scopes: list[str]) -> list[str]:
    """Names every branch of a fork defined itself: join(gather_variable) turns each into a list."""
    first = defined_in[branch_scopes[0]]
    return [name for name in first if all(name in defined_in[s] for s in branch_scopes)]


def parse_program_request(body: Any, limits: ProgramLimits | None = None) -> tuple[Program, bool]:
    """Body of POST /v1/programs (as JSON data) -> (validated program, stream?)."""
    req = _decoded(body)
    return validate_program(req.program, limits, req.args), req.stream


def _decoded(body: Any) -> Any:
    """JSON data as the endpoint decodes its body (a ProgramRequest), refused with the endpoint's own
    message and param (http/body.py's `invalid`)."""
    from services.gateway.http.body import invalid

    try:
        return msgspec.convert(body, ProgramRequest)
    except msgspec.ValidationError as e:
        err = invalid(e)
        raise InvalidRequest(err.message, err.param) from None
