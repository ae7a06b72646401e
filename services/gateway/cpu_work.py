"""CPU-heavy request preparation (tokenization, chat template rendering) kept off the event loop.

Small inputs are done inline while the loop has time for them (a credit of loop time, so a burst of them
cannot freeze it); large ones go to a pool of spawned processes that load the same tokenizer (a thread would
not do: the tokenizer holds the GIL while it builds the list of ids). A prompt longer in characters than
the context could hold at the tokenizer's longest token is refused before any of that.
"""
from __future__ import annotations

import array
import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from shared.parent_death import die_with_parent
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INLINE_CHARS = 16 * 1024  # inputs up to this size are prepared on the loop (a few milliseconds at most)
# Inline work is paid from a credit that refills at INLINE_SHARE of wall time, up to INLINE_BURST_S.
INLINE_SHARE = 0.25
INLINE_BURST_S = 0.005
ALWAYS_INLINE_CHARS = 2048  # smaller inputs stay inline whatever the credit: the hop would cost more

_TOKENIZER: Tokenizer | None = None  # in a pool process


def _init(path: str, chat_template: str | None, parent_pid: int) -> None:
    global _TOKENIZER
    die_with_parent(signal.SIGKILL, parent_pid)  # a SIGKILLed gateway leaves no pool process behind
    _TOKENIZER = Tokenizer.load(path)
    if chat_template and chat_template != _TOKENIZER.chat_template:  # the gateway's --chat-template
        _TOKENIZER.set_chat_template(chat_template)


def _render(tokenizer: Tokenizer, messages: list[dict], args: dict) -> str:
    args = dict(args)
    # A client's chat_template_kwargs never override the named arguments (nor collide with them).
    kwargs = {k: v for k, v in (args.pop("template_kwargs", None) or {}).items() if k not in args and k != "messages"}
    return tokenizer.apply_chat_template(messages, **args, **kwargs)


# Ids travel back as packed int32 bytes: unpickling a long list of ints would hold the gateway's GIL.
# `tokenizer`: the gateway's own, when no pool can run (None in a pool process: its _TOKENIZER).
def _encode(text: str, add_special_tokens: bool, tokenizer: Tokenizer | None = None) -> bytes:
    tokenizer = tokenizer or _TOKENIZER
    return array.array("i", tokenizer.encode(text, add_special_tokens=add_special_tokens)).tobytes()


def _render_and_encode(messages: list[dict], args: dict, tokenizer: Tokenizer | None = None) -> tuple[str, bytes]:
    text = _render(tokenizer or _TOKENIZER, messages, args)
    return text, _encode(text, False, tokenizer)


def _ids(packed: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(packed)
    return a.tolist()


def max_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token stands for (its vocabulary string is at least as
    long as the text it decodes to, for byte-level and sentencepiece vocabularies alike)."""
    vocab = tokenizer.raw.get_vocab(with_added_tokens=True)
    return max((len(k) for k in vocab), default=1) or 1


class CpuWork:
    def __init__(self, tokenizer: Tokenizer, tokenizer_path: str | None, processes: int = 1,
                 inline_chars: int = INLINE_CHARS):
        self.tokenizer = tokenizer
        self.path = tokenizer_path
        self.processes = processes
        self.inline_chars = inline_chars
        self.token_chars = max_token_chars(tokenizer)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._credit = INLINE_BURST_S  # seconds of inline work the loop can afford now
        self._credit_at = time.monotonic()

    def _inline(self, chars: int) -> bool:
        if chars > self.inline_chars:
            return False
        now = time.monotonic()
        self._credit = min(INLINE_BURST_S, self._credit + (now - self._credit_at) * INLINE_SHARE)
        self._credit_at = now
        return self._credit > 0 or chars <= ALWAYS_INLINE_CHARS

    def _spent(self, since: float) -> None:
        now = time.monotonic()
        self._credit -= now - since
        self._credit_at = now

    def chars_cannot_fit(self, chars: int, context_length: int | None) -> bool:
        # Twice the strict bound: a normalizer may drop characters before tokenization.
        return context_length is not None and chars > 2 * context_length * self.token_chars + 1024

    def _executor(self) -> concurrent.futures.Executor | None:
        if self._pool is None and self.path:
            # spawn, not fork: the gateway has threads (a forked lock may be held forever in the child).
            ctx = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=ctx,
                                                                initializer=_init,
                                                                initargs=(self.path, self.tokenizer.chat_template,
                                                                          os.getpid()))
        return self._pool

    async def _run(self, fn, *args) -> Any:
        """fn(*args) in a pool process; in a thread, with the gateway's tokenizer, when no pool can run (no
        loadable tokenizer path, or the pool broke)."""
        pool = self._executor()
        if pool is not None:
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
            except concurrent.futures.process.BrokenProcessPool:
                log.warning("the tokenizer pool broke (cannot load %s?); using a thread from now on", self.path)
                self.path, self._pool = None, None
        return await asyncio.to_thread(fn, *args, self.tokenizer)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._inline(len(text)):
            t0 = time.monotonic()
            try:
                return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            finally:
                self._spent(t0)
        return _ids(await self._run(_encode, text, add_special_tokens))

    async def render_chat(self, messages: list[dict], chars: int, args: dict) -> tuple[str, list[int]]:
        """The chat template applied (`args`: add_generation_prompt, tools, documents, ...,
        template_kwargs) and its token ids; `chars` is the messages' size, which decides where."""
        if self._inline(chars):
            t0 = time.monotonic()
            try:
                text = _render(self.tokenizer, messages, args)
                return text, self.tokenizer.encode(text, add_special_tokens=False)
            finally:
                self._spent(t0)
        text, packed = await self._run(_render_and_encode, messages, args)
        return text, _ids(packed)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

