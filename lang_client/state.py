"""`s`, the program state a program writes to, and the group `s.fork(n)` returns."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator

from lang_client.api import _role
from lang_client.expr import Concat, RoleBegin, RoleEnd, Text, to_expr
from lang_client.forks import ForkList
from lang_client.roles import RoleShortcuts
from lang_client.interpreter import Assign


class ProgramState(RoleShortcuts):
    def __init__(self, stream_executor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---- writing ----
    def __iadd__(self, other: Any) -> "ProgramState":
        self.stream_executor.submit(to_expr(other))
        return self

    def _role(self, role: str, expr: Any):
        if expr is not None:
            self.stream_executor.submit(_role(role, expr))
            return None
        return self._role_block(role)

    @contextlib.contextmanager
    def _role_block(self, role: str):
        self.stream_executor.submit(RoleBegin(role))
        yield self
        self.stream_executor.submit(RoleEnd(role))

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.submit(Assign(name, value))

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    # ---- reading (these wait) ----
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.var_events

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def sync(self) -> None:
        self.stream_executor.sync()

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self.stream_executor.messages_)

    def error(self) -> BaseException | None:
        return self.stream_executor.error_

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self.stream_executor.variables)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (run(..., stream=True)); with var_name, only that variable's pieces."""
        out = self.stream_executor.out_queue
        if out is None:  # not streamed: the whole text (or variable) at once, as SGLang's frontend does
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        while True:
            item = out.get()
            if item is None:
                out.put(None)  # let a second iterator end too
                if self.stream_executor.error_ is not None:
                    raise self.stream_executor.error_
                return
            name, chunk = item
            if var_name is None or name == var_name:
                yield chunk

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """text_iter for asyncio code: the waits run in a thread, so the event loop keeps serving. With
        return_meta_data (needs var_name), yields (chunk, meta_info of the variable so far)."""
        if return_meta_data and var_name is None:
            raise ValueError("text_async_iter(return_meta_data=True) needs a var_name")
        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        done = object()
        while True:
            chunk = await loop.run_in_executor(None, next, it, done)
            if chunk is done:
                return
            yield (chunk, self.stream_executor.meta_info.get(var_name)) if return_meta_data else chunk

    # ---- parallelism ----
    def fork(self, size: int = 1) -> "ProgramStateGroup":
        children = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup(ForkList):
    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork. gather_variable: each variable the forks set becomes a list in the parent;
        concate_and_append: the forks' new text is appended to the parent, in fork order."""
        executors = [s.stream_executor for s in self.states]
        for ex in executors:
            ex.sync()
            if ex.error_ is not None:
                raise ex.error_
        parent = self.src_state.stream_executor
        if mode == "gather_variable":
            names = [n for n in executors[0].defined_here if all(n in ex.defined_here for ex in executors)]
            for name in names:
                parent.submit(Assign(name, [ex.variables[name] for ex in executors]))
        elif mode == "concate_and_append":
            parent.submit(Concat([Text(ex.text_[ex.fork_start:]) for ex in executors]))
        else:
            raise ValueError(f"unknown join mode {mode!r}")
