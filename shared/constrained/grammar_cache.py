"""Compile grammars once per (kind, text), off the caller's thread, with a deadline.

One `GrammarCache` per process (gateway for validation, worker for decoding). xgrammar releases
the GIL while compiling, so a thread pool keeps the event loop and the engine loop responsive.
A compile cannot be interrupted once started: a timeout refuses the request, remembers the
grammar as rejected (so a client repeating it is refused at once instead of queueing more work),
and gives up on the thread: the compiler and its pool are replaced by fresh ones (compiles queued
behind the slow one move over), so a slow grammar never holds later, valid ones hostage. The old
thread finishes in the background; while too many such threads still run, new grammars are refused
rather than let them pile up.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import re
import logging
import threading
from collections import OrderedDict
from typing import Callable

import xgrammar as xgr

from shared.constrained.matcher import GrammarState
from shared.constrained.schema_fixes import harden_json_schema
from shared.constrained.vocab import VocabIndex, build_tokenizer_info
from shared.errors import InvalidRequest, Overloaded
from shared.limits import MAX_GRAMMAR_CHARS
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("regex", "json_schema", "ebnf", "json_object")
# The request field a problem is reported against, when the caller does not say.
DEFAULT_PARAM = {"regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf", "json_object": "response_format"}

GrammarKey = tuple[str, str]


class GrammarCache:
    def __init__(self, tokenizer: Tokenizer, model_vocab_size: int | None = None, *, max_threads: int = 2,
                 max_entries: int = 256, max_grammar_chars: int = MAX_GRAMMAR_CHARS, default_timeout_s: float = 10.0,
                 any_whitespace: bool = False, jump_forward: bool = True, max_abandoned: int = 4):
        self.tokenizer = tokenizer
        self.info = build_tokenizer_info(tokenizer, model_vocab_size)
        # Mask width (the logits' vocab), and the grammar's own: the tokenizer's ids, lm_head padding left
        # out (build_tokenizer_info), so it may be narrower.
        self.vocab_size = model_vocab_size or self.info.vocab_size
        self.grammar_vocab_size = self.info.vocab_size
        self.vocab = VocabIndex.build(self.info)
        self.max_entries = max_entries
        self.max_grammar_chars = max_grammar_chars
        self.default_timeout_s = default_timeout_s
        # Compact JSON (no free whitespace) keeps forced runs long for jump-forward and stops a
        # weak model from looping on whitespace; `json_object` keeps the builtin lenient grammar.
        self.any_whitespace = any_whitespace
        self.jump_forward = jump_forward
        self.max_threads = max_threads
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._new_compiler()
        # Compiles given up on (timed out) and still running in an old pool's thread.
        self._abandoned: set[GrammarKey] = set()
        self.pool_replacements = 0
        self._compiled: OrderedDict[GrammarKey, xgr.CompiledGrammar] = OrderedDict()
        # (message, param) rather than exception objects: re-raising one object grows its traceback.
        self._rejected: OrderedDict[GrammarKey, tuple[str, str | None]] = OrderedDict()
        # key -> (the future callers hold, the pool's own future for it)
        self._inflight: dict[GrammarKey, tuple[cf.Future, cf.Future]] = {}
        self.hits = 0
        self.misses = 0

    # ---- public API ----
    def submit(self, kind: str, text: str | None, param: str | None = None) -> cf.Future:
        """A future of the CompiledGrammar; done at once on a cache hit. Never blocks.

        The future raises InvalidRequest for a bad grammar (also for an unknown kind or an
        oversized text), Overloaded while too many abandoned compiles still run. Callers that must not wait (the engine's scheduler) poll `.done()`.
        """
        try:
            key = self._key(kind, text, param)
        except InvalidRequest as e:
            return _done(exc=e)
        with self._lock:
            if key in self._rejected:
                message, rejected_param = self._rejected[key]
                return _done(exc=InvalidRequest(message, param or rejected_param))
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return _done(result=compiled)
            entry = self._inflight.get(key)
            if entry is not None:
                return entry[0]
            if len(self._abandoned) >= self.max_abandoned:
                # Not remembered in _rejected: the grammar itself may be fine once the compiler frees up.
                return _done(exc=Overloaded(
                    "the grammar compiler is busy with grammars that took too long; retry later"))
            self.misses += 1
            fut: cf.Future = cf.Future()
            self._inflight[key] = (fut, self._start(key, param or DEFAULT_PARAM[kind], fut))
            return fut

    def compile(self, kind: str, text: str | None, timeout_s: float | None = None,
                param: str | None = None) -> xgr.CompiledGrammar:
        """Blocking compile (worker side). Raises InvalidRequest on a bad grammar or timeout."""
        fut = self.submit(kind, text, param)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=timeout)
        except cf.TimeoutError:
            raise self._timed_out(kind, text, timeout, param) from None

    async def compile_async(self, kind: str, text: str | None, timeout_s: float | None = None,
                            param: str | None = None) -> xgr.CompiledGrammar:
        """Compile without blocking the event loop (gateway validation)."""
        fut = self.submit(kind, text, param)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            # shield: the compile is shared with other waiters; our timeout must not cancel it.
            waited = asyncio.wrap_future(fut)
            # A refusal that lands after our timeout is nobody's to read: mark it read.
            waited.add_done_callback(lambda f: f.cancelled() or f.exception())
            return await asyncio.wait_for(asyncio.shield(waited), timeout)
        except asyncio.TimeoutError:
            raise self._timed_out(kind, text, timeout, param) from None

    def new_state(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState.create(compiled, self.vocab, jump_forward=self.jump_forward)

    def state_for(self, kind: str, text: str | None, timeout_s: float | None = None) -> GrammarState:
        return self.new_state(self.compile(kind, text, timeout_s))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def abandon(self, kind: str, text: str | None, timeout: float, param: str | None = None) -> InvalidRequest:
        """Give up on a compile that took too long (the worker's deadline); returns the refusal."""
        return self._timed_out(kind, text, timeout, param)

    def __len__(self) -> int:
        return len(self._compiled)

    # ---- internals ----
    def _new_compiler(self) -> None:
        # Our LRU is the only cache, so memory stays bounded by max_entries.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=self.max_threads, cache_enabled=False)
        self._pool = cf.ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="grammar")

    def _start(self, key: GrammarKey, param: str, fut: cf.Future) -> cf.Future:
        """Run the compile on the current pool; its outcome lands in `fut` (the callers' future)."""
        compiler = self._compiler
        job = self._pool.submit(self._compile_now, key, param, compiler)

        def relay(job: cf.Future) -> None:
            if job.cancelled() or fut.done():
                return  # moved to a new pool, or refused already
            exc = job.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(job.result())
        job.add_done_callback(relay)
        return job

    def _replace_pool_locked(self, stuck: GrammarKey) -> None:
        """The compile of `stuck` is running too long: start a fresh compiler and pool; compiles
        still queued on the old pool move to the new one; running ones finish where they are."""
        old = self._pool
        self._abandoned.add(stuck)
        self._new_compiler()
        self.pool_replacements += 1
        for key, (fut, job) in list(self._inflight.items()):
            if key != stuck and job.cancel():
                param = DEFAULT_PARAM[key[0]]
                self._inflight[key] = (fut, self._start(key, param, fut))
        old.shutdown(wait=False)
        log.warning("a %s compile ran past its deadline; compiler pool replaced (%d still running)",
                    stuck[0], len(self._abandoned))

    def _key(self, kind: str, text: str | None, param: str | None) -> GrammarKey:
        if kind not in KINDS:
            raise InvalidRequest(f"unknown grammar kind '{kind}'", param or "response_format")
        if kind == "json_object":
            return kind, ""
        if not isinstance(text, str):
            raise InvalidRequest(f"{kind} must be a string", param or DEFAULT_PARAM[kind])
        if len(text) > self.max_grammar_chars:
            raise InvalidRequest(f"{kind} is too large ({len(text)} characters, at most "
                                 f"{self.max_grammar_chars})", param or DEFAULT_PARAM[kind])
        return kind, text

    def _compile_now(self, key: GrammarKey, param: str, compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
        kind, text = key
        try:
            compiled = self._builders(compiler)[kind](text)
        except InvalidRequest as e:
            err = InvalidRequest(e.message, param)
            self._finish(key, error=err)
            raise err from None
        except Exception as e:  # xgrammar reports every grammar problem as RuntimeError
            err = InvalidRequest(f"invalid {kind}: {_clean_xgrammar_error(e)}", param)
            self._finish(key, error=err)
            raise err from None
        self._finish(key, compiled=compiled)
        return compiled

    def _builders(self, c: xgr.GrammarCompiler) -> dict[str, Callable[[str], xgr.CompiledGrammar]]:
        return {
            "regex": c.compile_regex,
            "json_schema": lambda text: self._compile_json_schema(c, text),
            "ebnf": c.compile_grammar,
            "json_object": lambda _: c.compile_builtin_json_grammar(),
        }

    def _compile_json_schema(self, compiler: xgr.GrammarCompiler, text: str) -> xgr.CompiledGrammar:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"json_schema is not valid JSON: {e}", "json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("json_schema must be a JSON object", "json_schema")
        return compiler.compile_json_schema(json.dumps(harden_json_schema(schema)),
                                            any_whitespace=self.any_whitespace)

    def _finish(self, key: GrammarKey, compiled: xgr.CompiledGrammar | None = None,
                error: InvalidRequest | None = None) -> None:
        with self._lock:
            self._abandoned.discard(key)
            self._inflight.pop(key, None)
            if error is not None:
                _put_bounded(self._rejected, key, (error.message, error.param), self.max_entries)
            elif key not in self._rejected:  # a timed-out grammar stays refused
                _put_bounded(self._compiled, key, compiled, self.max_entries)

    def _timed_out(self, kind: str, text: str | None, timeout: float, param: str | None) -> InvalidRequest:
        err = InvalidRequest(f"{kind} took longer than {timeout:g}s to compile; simplify it",
                             param or DEFAULT_PARAM.get(kind, "response_format"))
        key = self._key(kind, text, param)
        with self._lock:
            _put_bounded(self._rejected, key, (err.message, err.param), self.max_entries)
            entry = self._inflight.pop(key, None)
            if entry is not None:
                fut, job = entry
                if not fut.done():
                    fut.set_exception(InvalidRequest(err.message, err.param))
                if not job.cancel():  # running: it holds a thread of the pool
                    self._replace_pool_locked(key)
        return err


def _put_bounded(d: OrderedDict, key, value, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


def _done(result=None, exc: BaseException | None = None) -> cf.Future:
    fut: cf.Future = cf.Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
    return fut


_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _clean_xgrammar_error(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source path; keep only the reason."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", msg)[:500]
