"""Execution of a validated program (ir.py): a small async interpreter over an injected `generate(body)`
with the native /generate endpoint's shape. The select and fork warm-up bodies are lang_client's own, so
a remote run asks what a local one does. Nothing may hold the loop long or grow without a bound: a
stream's text is kept as parts, every character is announced to `bounds.add_text` before it is held, a
select holds its scoring batch's prompt tokens before it builds the batch, and the interpreter yields to
the loop every few nodes."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from lang_client import wire
from lang_client.choices import resolve_method
from msgspec import UNSET

from services.gateway.programs.ir import (ForkOp, GenOp, IfOp, JoinOp, Program, RoleBeginOp, RoleEndOp, SelectOp,
                                         SetOp, TextOp, VarOp, if_holds)

Generate = Callable[[dict], Awaitable[Any]]


class ProgramError(RuntimeError):
    """A generate call inside the program failed."""


class Bounds:
    """What a run may hold and ask for: anything, here; a subclass (limits.py's ProgramMeter) raises its
    error from a method to refuse."""

    def add_text(self, chars: int) -> None:
        """`chars` more characters of text are about to be held (a stream, a message or a variable)."""

    def hold_prompt_tokens(self, tokens: int) -> None:
        """The calling task's next generate call needs at least `tokens` prompt tokens: hold them now,
        before its body is built (the call's own reservation replaces the hold)."""


YIELD_EVERY = 64  # nodes a stream runs between two yields to the event loop


class _Stream:
    """A stream's text as the parts appended to it (joined only when a generate call needs one string),
    its messages, and where (in characters) its open role and its fork began."""

    __slots__ = ("parts", "chars", "messages", "role_start", "fork_start")

    def __init__(self, parts: list[str] | None = None, messages: list[dict[str, str]] | None = None,
                 role_start: int = 0):
        self.parts = parts or []
        self.chars = sum(len(p) for p in self.parts)
        self.messages = messages if messages is not None else []
        self.role_start = role_start
        self.fork_start = self.chars

    def append(self, s: str) -> None:
        if s:
            self.parts.append(s)
            self.chars += len(s)

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]  # kept joined: the next call joins from here
        return self.parts[0] if self.parts else ""

    def since(self, start: int) -> str:
        """The text from character `start` on, joining only the parts it spans."""
        need, tail = self.chars - start, []
        for part in reversed(self.parts):
            if need <= 0:
                break
            tail.append(part if len(part) <= need else part[len(part) - need:])
            need -= len(part)
        return "".join(reversed(tail))

    def copy(self) -> "_Stream":
        # Joined first, so every branch of a fork shares one string of the prefix.
        return _Stream([self.text()] if self.chars else [], list(self.messages), self.role_start)


def _chars(value: Any) -> int:
    """Characters of text a variable's value holds (a set value's JSON data counted when validated)."""
    if isinstance(value, str):
        return len(value)
    return sum(_chars(v) for v in value) if isinstance(value, list) else 0


class _Run:
    def __init__(self, program: Program, generate: Generate, on_variable, fork_hint: bool = True,
                 bounds: Bounds | None = None):
        self.reads, self.joins = program.reads, program.joins
        self.generate = generate
        self.bounds = bounds or Bounds()
        self.steps = 0  # nodes run since the last yield to the loop
        self.on_variable = on_variable
        self.fork_hint = fork_hint
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

    async def _define(self, scope: str, name: str | None, value: Any, meta: Any, counted: bool = False) -> None:
        if name is None:
            return
        if not counted:
            # The answer holds every variable apart from the text: a gathered list repeats its branches' values.
            self.bounds.add_text(_chars(value))
        key = (scope, name)
        index = self.def_counts.get(key, 0)
        self.def_counts[key] = index + 1
        fut = self._future(scope, name, index)
        if not fut.done():
            fut.set_result(value)
        scoped = wire.scoped_name(scope, name)
        self.values[scoped], self.meta[scoped] = value, meta
        self.defined_in.setdefault(scope, [])
        if name not in self.defined_in[scope]:
            self.defined_in[scope].append(name)
        if self.on_variable is not None:
            await self.on_variable(scoped, value, meta)

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

    def _append(self, st: _Stream, s: str) -> None:
        self.bounds.add_text(len(s))
        st.append(s)

    async def stream(self, nodes: list, scope: str, st: _Stream) -> None:
        """Run validated ops (validate.py: args bound, role texts filled in, reads in Program's tables)."""
        for node in nodes:
            self.steps += 1
            if self.steps >= YIELD_EVERY:
                self.steps = 0
                await asyncio.sleep(0)
            if isinstance(node, (TextOp, RoleBeginOp)):
                self._append(st, node.text)
                if isinstance(node, RoleBeginOp):
                    st.role_start = st.chars
            elif isinstance(node, RoleEndOp):
                # As the client's interpreter (and SGLang's): leading whitespace is not content.
                self.bounds.add_text(st.chars - st.role_start)
                st.messages.append({"role": node.role, "content": st.since(st.role_start).lstrip()})
                self._append(st, node.text)
            elif isinstance(node, GenOp):
                logprob = {key: value for key, value in (("return_logprob", node.return_logprob),
                                                         ("logprob_start_len", node.logprob_start_len),
                                                         ("top_logprobs_num", node.top_logprobs_num))
                           if value is not None}  # top-level /generate keys
                answer = await self._call({"text": st.text(), "sampling_params": dict(node.sampling_params),
                                           **logprob})
                self._append(st, answer["text"])
                await self._define(scope, node.name, answer["text"], answer.get("meta_info"))
            elif isinstance(node, SelectOp):
                decision, meta = await self._select(st.text(), node)
                self._append(st, decision)
                await self._define(scope, node.name, decision, meta)
            elif isinstance(node, VarOp):
                self._append(st, await self._read(node))
            elif isinstance(node, SetOp):
                value = node.value
                if node.parts is not UNSET:
                    parts = [p.text if isinstance(p, TextOp) else await self._read(p) for p in node.parts]
                    self.bounds.add_text(sum(len(p) for p in parts))  # before the join: x = x + x doubles
                    value = "".join(parts)
                await self._define(scope, node.name, value, None, counted=node.parts is not UNSET)
            elif isinstance(node, ForkOp):
                await self._fork(node, st)
            elif isinstance(node, JoinOp):
                await self._join(node, scope, st)
            elif isinstance(node, IfOp):
                cond = node.cond
                actual = await self._future(cond.scope, cond.var, self.reads[id(node)])
                await self.stream(node.then if if_holds(cond, actual) else node.orelse, scope, st)

    def _read(self, node: VarOp) -> asyncio.Future:
        return self._future(node.scope, node.name, self.reads[id(node)])

    def close_scope(self, scope: str) -> None:
        """The stream of `scope` ended: a read still waiting on one of its variables never gets a value
        (the path taken did not define it), so it fails instead of hanging."""
        for (s, name), futs in self.futures.items():
            for fut in futs:
                if s == scope and not fut.done():
                    fut.set_exception(ProgramError(f"variable {name!r} was never defined on the path the "
                                                   "program took"))
                    fut.exception()

    async def _fork(self, node: ForkOp, st: _Stream) -> None:
        if self.fork_hint and wire.should_warm_fork(len(node.branches), st.text()):
            # One prefill of the shared prefix, so every branch finds it in the radix cache.
            await self._call(wire.prefill_body(st.text()))
        states = [st.copy() for _ in node.branches]
        scopes = [f"f{node.id}.{i}" for i in range(len(node.branches))]
        tasks = [asyncio.ensure_future(self._branch(b, s, bst)) for b, s, bst in zip(node.branches, scopes, states)]
        self.tasks.extend(tasks)
        self.forks[node.id] = (tasks, states, scopes)

    async def _branch(self, nodes: list, scope: str, st: _Stream) -> None:
        self.defined_in.setdefault(scope, [])
        try:
            await self.stream(nodes, scope, st)
            self.close_scope(scope)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.fail(e)
            raise

    async def _join(self, node: JoinOp, scope: str, st: _Stream) -> None:
        tasks, states, scopes = self.forks[node.fork]
        await asyncio.gather(*tasks)
        if node.mode == "gather_variable":
            names, maybe = self.joins[id(node)]
            maybe = [m for m in maybe if all(m in self.defined_in.get(s, []) for s in scopes)]
            for name in names + maybe:
                values = [self.values[wire.scoped_name(s, name)] for s in scopes]
                await self._define(scope, name, values, [self.meta.get(wire.scoped_name(s, name)) for s in scopes])
        else:
            for b in states:
                self._append(st, b.since(b.fork_start))

    async def _select(self, text: str, node: SelectOp) -> tuple[str, dict]:
        first = await self._call(wire.prefill_body(text))
        # Each scored text holds the prompt, bar the last tokens a choice's head may merge with: a batch
        # that cannot fit what the budget has left is refused before its len(choices) copies are made.
        self.bounds.hold_prompt_tokens(len(node.choices) * max(first["meta_info"]["prompt_tokens"] - 2, 0))
        answers = await self._call(wire.choice_scoring_body(text, node.choices, node.temperature,
                                                            first["meta_info"]["prompt_tokens"]))
        try:
            per_choice = wire.choice_logprobs(answers, len(node.choices))
        except ValueError as e:
            raise ProgramError(str(e)) from None
        decision = resolve_method(node.method)(node.choices, per_choice)
        return decision.decision, decision.meta_info

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
                          on_variable: Callable[[str, Any, Any], Awaitable[None]] | None = None,
                          fork_hint: bool = True, bounds: Bounds | None = None) -> dict:
    """Run a validated program. `generate(body)` takes and returns /generate JSON (a list for a batch);
    `bounds` refuses text and prompts past the caller's limits (none by default).

    Every fork's branches start together, right after one max_new_tokens=0 warm-up of their shared prefix
    (the fork prefix hint; `fork_hint=False`, the gateway's --disable-fork-hint, leaves it out).
    """
    run = _Run(program, generate, on_variable, fork_hint, bounds)
    root = _Stream()
    try:
        await run.stream(program.nodes, "", root)
        run.close_scope("")
        await run.wait_all()
    except BaseException as e:
        run.fail(e)
        await asyncio.gather(*run.tasks, return_exceptions=True)
        raise (run.error if not isinstance(e, asyncio.CancelledError) else e)
    return {"text": root.text(), "messages": root.messages, "variables": run.values, "meta_info": run.meta}


async def stream_program(program: Program, generate: Generate, fork_hint: bool = True,
                         bounds: Bounds | None = None) -> AsyncIterator[dict]:
    """Events for SSE: each variable as it completes, then the whole result."""
    events: asyncio.Queue = asyncio.Queue()

    async def on_variable(name, value, meta):
        await events.put({"type": "variable", "name": name, "value": value, "meta_info": meta})

    task = asyncio.ensure_future(execute_program(program, generate, on_variable, fork_hint, bounds))
    task.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield event
        result = task.result()  # raises the program's error, if any
        yield {"type": "result", **result}
    finally:
        if not task.done():
            task.cancel()
