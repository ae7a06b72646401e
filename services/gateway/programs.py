"""`POST /v1/programs`: run a traced language-model program (lang_client's IR, version 1) server-side.

The IR is data, never code: it is checked node by node against a closed schema and ProgramLimits, then
walked by a small async interpreter. Generation goes through an injected `generate(body) -> answer`
with the shape of the native /generate endpoint, so this module knows nothing of the gateway's insides.

Request body: {"program": IR, "args": {name: str}, "stream": bool}
Answer: {"text", "messages", "variables": {scoped name: value}, "meta_info": {scoped name: meta}}
Scoped names: "name" in the main stream, "f<fork id>.<branch>.name" inside a fork branch.
Streaming: {"type": "variable", "name", "value", "meta_info"} per variable as it completes, then
{"type": "result", ...the answer}.
"""
from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams

IR_VERSION = 1
ROLES = ("system", "user", "assistant")
# Used when a role node carries no rendered text (the client normally sends its template's markers).
CHATML_ROLES = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
SELECT_METHODS = ("token_length_normalized", "greedy_token_selection")
JOIN_MODES = ("gather_variable", "concate_and_append")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_SCOPE = re.compile(r"^(|f\d+\.\d+)$")

Generate = Callable[[dict], Awaitable[Any]]


@dataclass(frozen=True)
class ProgramLimits:
    max_nodes: int = 4096              # every node, branches included
    max_fork_width: int = 64           # n of one fork
    max_total_tokens: int = 131072     # sum of max_new_tokens over all gens (default 128 each)
    max_depth: int = 8                 # fork nesting
    max_text_chars: int = 1_000_000    # literal text, role markers, choices, grammars and bound args
    max_choices: int = 256             # choices of one select
    max_name_chars: int = 128


# ---- the validated program ----
@dataclass
class TextNode:
    text: str


@dataclass
class RoleNode:
    role: str
    begin: bool
    text: str


@dataclass
class GenNode:
    name: str | None
    sampling_params: dict[str, Any]
    logprob: dict[str, Any] = field(default_factory=dict)  # top-level /generate logprob keys


@dataclass
class SelectNode:
    name: str | None
    choices: list[str]
    temperature: float
    method: str


@dataclass
class ForkNode:
    id: int
    branches: list[list[Any]]


@dataclass
class JoinNode:
    fork: int
    mode: str


@dataclass
class VarNode:
    name: str
    scope: str
    def_index: int  # which definition of (scope, name) this read sees, fixed at validation


@dataclass
class Program:
    nodes: list[Any]
    name: str = "program"
    node_count: int = 0
    total_tokens: int = 0


# ---- validation ----
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
        self.total_tokens = 0
        self.text_chars = 0
        self.fork_ids: dict[int, tuple[str, list[str]]] = {}  # id -> (parent scope, branch scopes)
        self.scopes = {""}
        # (scope, name) -> kind of each definition in walk order ("str" or "list" for gathered values)
        self.defs: dict[tuple[str, str], list[str]] = {}
        self.defined_in: dict[str, list[str]] = {"": []}   # scope -> names it defined itself

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
        if not isinstance(value, str) or not _NAME.match(value) or len(value) > self.limits.max_name_chars:
            raise InvalidRequest(f"{path} must be a name (letters, digits, _ and -, at most "
                                 f"{self.limits.max_name_chars} characters)", path)
        return value

    def define(self, scope: str, name: str | None, kind: str = "str") -> None:
        if name is None:
            return
        self.defs.setdefault((scope, name), []).append(kind)
        if name not in self.defined_in[scope]:
            self.defined_in[scope].append(name)

    def nodes(self, raw: Any, path: str, scope: str, depth: int, role: str | None) -> tuple[list, str | None]:
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
            handler = getattr(self, "op_" + node["op"], None)
            if handler is None:
                raise InvalidRequest(f"{p}: unknown op {node['op']!r}", f"{p}.op")
            result, role = handler(node, p, scope, depth, role)
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
        for key in ("regex", "json_schema", "ebnf"):
            if getattr(params, key):
                self.add_text(getattr(params, key), f"{p}.sampling_params.{key}")
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
        if mode == "gather_variable":
            for name in _gathered(self.defined_in, self.fork_ids[fid][1]):
                self.define(scope, name, kind="list")
        return JoinNode(fid, mode), role

    def op_var(self, n, p, scope, depth, role):
        _no_extra_keys(n, {"op", "name", "scope"}, p)
        name = self.name(n.get("name"), f"{p}.name", optional=False)
        vscope = n.get("scope", "")
        if not isinstance(vscope, str) or not _SCOPE.match(vscope) or vscope not in self.scopes:
            raise InvalidRequest(f"{p}.scope must name the main stream or an earlier fork branch", f"{p}.scope")
        kinds = self.defs.get((vscope, name))
        if not kinds:
            raise InvalidRequest(f"{p}: variable {name!r} is read before it is defined", f"{p}.name")
        if kinds[-1] != "str":
            raise InvalidRequest(f"{p}: variable {name!r} holds a gathered list and cannot be appended as text",
                                 f"{p}.name")
        return VarNode(name, vscope, len(kinds) - 1), role


def _gathered(defined_in: dict[str, list[str]], branch_scopes: list[str]) -> list[str]:
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


# ---- execution ----
class ProgramError(RuntimeError):
    """A generate call inside the program failed."""


@dataclass
class _Stream:
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    role_start: int = 0
    fork_start: int = 0

    def copy(self) -> "_Stream":
        return _Stream(self.text, list(self.messages), self.role_start, len(self.text))


def _scoped(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


class _Run:
    def __init__(self, generate: Generate, on_variable):
        self.generate = generate
        self.on_variable = on_variable
        self.futures: dict[tuple[str, str], list[asyncio.Future]] = {}
        self.def_counts: dict[tuple[str, str], int] = {}
        self.defined_in: dict[str, list[str]] = {"": []}
        self.values: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.forks: dict[int, tuple[list[asyncio.Task], list[_Stream], list[str]]] = {}
        self.tasks: list[asyncio.Task] = []
        self.error: BaseException | None = None

    def _future(self, scope: str, name: str, index: int) -> asyncio.Future:
        futs = self.futures.setdefault((scope, name), [])
        while len(futs) <= index:
            fut = asyncio.get_running_loop().create_future()
            if self.error is not None:
                fut.set_exception(self.error)
            futs.append(fut)
        return futs[index]

    async def _define(self, scope: str, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        key = (scope, name)
        index = self.def_counts.get(key, 0)
        self.def_counts[key] = index + 1
        fut = self._future(scope, name, index)
        if not fut.done():
            fut.set_result(value)
        self.values[_scoped(scope, name)] = value
        self.meta[_scoped(scope, name)] = meta
        self.defined_in.setdefault(scope, [])
        if name not in self.defined_in[scope]:
            self.defined_in[scope].append(name)
        if self.on_variable is not None:
            await self.on_variable(_scoped(scope, name), value, meta)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for futs in self.futures.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # mark retrieved: the error is reported once, by execute_program
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()

    async def _call(self, body: dict) -> Any:
        answer = await self.generate(body)
        if isinstance(answer, dict) and "error" in answer:
            err = answer["error"]
            raise ProgramError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        return answer

    async def stream(self, nodes: list, scope: str, st: _Stream) -> None:
        for node in nodes:
            if isinstance(node, TextNode):
                st.text += node.text
            elif isinstance(node, RoleNode):
                if node.begin:
                    st.text += node.text
                    st.role_start = len(st.text)
                else:
                    # As the client's interpreter (and SGLang's): leading whitespace is not content.
                    st.messages.append({"role": node.role, "content": st.text[st.role_start:].lstrip()})
                    st.text += node.text
            elif isinstance(node, GenNode):
                answer = await self._call({"text": st.text, "sampling_params": dict(node.sampling_params),
                                           **node.logprob})
                st.text += answer["text"]
                await self._define(scope, node.name, answer["text"], answer.get("meta_info"))
            elif isinstance(node, SelectNode):
                decision, meta = await self._select(st.text, node)
                st.text += decision
                await self._define(scope, node.name, decision, meta)
            elif isinstance(node, VarNode):
                st.text += await self._future(node.scope, node.name, node.def_index)
            elif isinstance(node, ForkNode):
                await self._fork(node, st)
            elif isinstance(node, JoinNode):
                await self._join(node, scope, st)

    async def _fork(self, node: ForkNode, st: _Stream) -> None:
        if len(node.branches) > 1 and st.text:
            # One prefill of the shared prefix, so every branch finds it in the radix cache.
            await self._call({"text": st.text, "sampling_params": {"max_new_tokens": 0}})
        states = [st.copy() for _ in node.branches]
        scopes = [f"f{node.id}.{i}" for i in range(len(node.branches))]
        tasks = [asyncio.ensure_future(self._branch(b, s, bst)) for b, s, bst in zip(node.branches, scopes, states)]
        self.tasks.extend(tasks)
        self.forks[node.id] = (tasks, states, scopes)

    async def _branch(self, nodes: list, scope: str, st: _Stream) -> None:
        self.defined_in.setdefault(scope, [])
        try:
            await self.stream(nodes, scope, st)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.fail(e)
            raise

    async def _join(self, node: JoinNode, scope: str, st: _Stream) -> None:
        tasks, states, scopes = self.forks[node.fork]
        await asyncio.gather(*tasks)
        if node.mode == "gather_variable":
            for name in _gathered(self.defined_in, scopes):
                values = [self.values[_scoped(s, name)] for s in scopes]
                await self._define(scope, name, values, [self.meta.get(_scoped(s, name)) for s in scopes])
        else:
            st.text += "".join(b.text[b.fork_start:] for b in states)

    async def _select(self, text: str, node: SelectNode) -> tuple[str, dict]:
        first = await self._call({"text": text, "sampling_params": {"max_new_tokens": 0}})
        prompt_tokens = first["meta_info"]["prompt_tokens"]
        answers = await self._call({
            "text": [text + c for c in node.choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": node.temperature},
            "return_logprob": True, "return_text_in_logprobs": True,
            # two tokens early: the prompt's tail may merge with the choice's head (token healing)
            "logprob_start_len": max(prompt_tokens - 2, 0),
        })
        if not isinstance(answers, list) or len(answers) != len(node.choices):
            raise ProgramError("select: generate did not answer the batch with one result per choice")
        per_choice = [[e[0] for e in a["meta_info"]["input_token_logprobs"] if e and e[0] is not None]
                      for a in answers]
        if node.method == "token_length_normalized":
            scores = [sum(lps) / len(lps) if lps else -math.inf for lps in per_choice]
            best = max(range(len(scores)), key=lambda i: scores[i])
            return node.choices[best], {"normalized_prompt_logprobs": scores}
        width = max(len(lps) for lps in per_choice)
        padded = [lps + [-math.inf] * (width - len(lps)) for lps in per_choice]
        best = max(range(len(padded)), key=lambda i: padded[i])
        return node.choices[best], {"input_token_logprobs": per_choice}

    async def wait_all(self) -> None:
        while True:  # branches may start nested forks, so the task list grows while we wait
            pending = [t for t in self.tasks if not t.done()]
            if not pending:
                for t in self.tasks:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()
                return
            await asyncio.gather(*pending)


async def execute_program(program: Program, generate: Generate,
                          on_variable: Callable[[str, Any, Any], Awaitable[None]] | None = None) -> dict:
    """Run a validated program. `generate(body)` takes and returns /generate JSON (a list for a batch).

    Every fork's branches start together, right after one max_new_tokens=0 warm-up of their shared prefix.
    """
    run = _Run(generate, on_variable)
    root = _Stream()
    try:
        await run.stream(program.nodes, "", root)
        await run.wait_all()
    except BaseException as e:
        run.fail(e)
        await asyncio.gather(*run.tasks, return_exceptions=True)
        raise (run.error if not isinstance(e, asyncio.CancelledError) else e)
    return {"text": root.text, "messages": root.messages, "variables": run.values, "meta_info": run.meta}


async def stream_program(program: Program, generate: Generate) -> AsyncIterator[dict]:
    """Events for SSE: each variable as it completes, then the whole result."""
    events: asyncio.Queue = asyncio.Queue()

    async def on_variable(name, value, meta):
        await events.put({"type": "variable", "name": name, "value": value, "meta_info": meta})

    task = asyncio.ensure_future(execute_program(program, generate, on_variable))
    task.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield event
        result = task.result()  # raises the program's error, if any
        yield {"type": "result", **result}
    finally:
        if not task.done():
            task.cancel()
