"""`@function`: a program, run in interpreter mode, as a batch, or remotely from its traced IR."""
from __future__ import annotations

import functools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from lang_client.api import get_default_backend
from lang_client.chat_template import CHATML
from lang_client.interpreter import StreamExecutor
from lang_client.remote import RemoteExecutor
from lang_client.state import ProgramState
from lang_client.trace_rewrite import instrument
from lang_client.tracer import TracerState, constant_prefix, trace_program

# run_batch warms the cache with the program's constant prefix only when it is worth a request.
MIN_BATCH_PREFIX_CHARS = 64

_SAMPLING_DEFAULTS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature",
                      "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None):
    """Decorator: `@function` or `@function(num_api_spec_tokens=64)`; the first parameter is the state."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func)


def _split_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop run-level sampling defaults (apply to every gen that does not set its own) out of kwargs."""
    defaults = {}
    for key in _SAMPLING_DEFAULTS:
        value = kwargs.pop(key, None)
        if value is not None:
            defaults[key] = [value] if key in ("stop", "stop_regex") and isinstance(value, str) else value
    return defaults


def _wait_all(executor: StreamExecutor) -> None:
    executor.sync()
    for child in executor.children:
        _wait_all(child)


class SglFunction:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "SglFunction":
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args, **kwargs):
        # Called with a state first: a sub-program inlined into the caller's stream.
        if args and isinstance(args[0], TracerState):  # strings it builds are tracked as in the caller
            return instrument(self.func)(*args, **{**self.bind_arguments, **kwargs})
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    @staticmethod
    def _backend(backend):
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError("no backend: pass backend= or call set_default_backend(RuntimeEndpoint(url))")
        return backend

    # ---- interpreter mode ----
    def run(self, *args, stream: bool = False, backend=None, remote: bool = False, **kwargs) -> ProgramState:
        backend = self._backend(backend)
        defaults = _split_defaults(kwargs)
        if remote:
            return self._run_remote(args, kwargs, defaults, backend, stream)
        return self._run_local(args, kwargs, defaults, backend, stream, raise_errors=True)

    def _run_local(self, args, kwargs, defaults, backend, stream, raise_errors) -> ProgramState:
        executor = StreamExecutor(backend, defaults, stream=stream, num_api_spec_tokens=self.num_api_spec_tokens)
        state = ProgramState(executor)
        call_kwargs = {**self.bind_arguments, **kwargs}

        def body():
            try:
                state.ret_value = self.func(state, *args, **call_kwargs)
            except BaseException as e:
                if executor.error_ is None:
                    executor.error_ = e
            finally:
                executor.end()

        if stream:
            threading.Thread(target=body, daemon=True, name="lang-program").start()
            return state
        body()
        _wait_all(executor)
        if raise_errors and executor.error_ is not None:
            raise executor.error_
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend=None, num_threads: int | str = "auto",
                  progress_bar: bool = False, remote: bool = False, **sampling) -> list[ProgramState]:
        """Run once per kwargs dict, concurrently. Failures stay in each state's error()."""
        if not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch takes a list of keyword-argument dicts")
        backend = self._backend(backend)
        defaults = _split_defaults(dict(sampling))
        if not batch_kwargs:
            return []
        if len(batch_kwargs) > 1 and not remote:
            self._warm_prefix(backend, defaults)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch_kwargs)))

        def one(kwargs):
            if remote:
                state = self._run_remote((), dict(kwargs), defaults, backend, False, raise_errors=False)
            else:
                state = self._run_local((), dict(kwargs), defaults, backend, False, raise_errors=False)
            return state

        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(one, kwargs) for kwargs in batch_kwargs]
            states = []
            for i, fut in enumerate(futures):
                states.append(fut.result())
                if progress_bar:
                    print(f"\r{self.__name__}: {i + 1}/{len(futures)}", end="", file=sys.stderr, flush=True)
            if progress_bar:
                print(file=sys.stderr)
        return states

    def _warm_prefix(self, backend, defaults) -> None:
        try:
            ir = self.trace(backend=backend, **defaults)
        except Exception:  # programs that cannot be traced with placeholders simply get no warm-up
            return
        prefix = constant_prefix(ir)
        if len(prefix) > MIN_BATCH_PREFIX_CHARS:
            backend.cache_prefix(prefix)

    # ---- compiler mode ----
    def trace(self, *args, backend=None, **kwargs) -> dict:
        """The program's IR (see lang_client.tracer); arguments not given become placeholders."""
        backend = backend or get_default_backend()
        defaults = _split_defaults(kwargs)
        template = backend.get_chat_template() if backend is not None else CHATML
        return trace_program(self.func, args, {**self.bind_arguments, **kwargs}, template, defaults)

    def _run_remote(self, args, kwargs, defaults, backend, stream, raise_errors=True) -> ProgramState:
        # Traced with the real arguments: Python may loop over them; only generated values must not steer.
        ir = trace_program(self.func, args, {**self.bind_arguments, **kwargs}, backend.get_chat_template(),
                           defaults)
        executor = RemoteExecutor(backend, ir, {}, stream)
        state = ProgramState(executor)
        if not stream:
            executor.sync()
            if raise_errors and executor.error_ is not None:
                raise executor.error_
        return state
