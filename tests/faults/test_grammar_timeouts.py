"""A grammar compile that runs past its deadline is given up on for real: the slow compile no longer
holds the compiler's threads, so a valid grammar sent during it, and right after, compiles at once."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from shared.constrained import GrammarCache
from shared.errors import InvalidRequest, Overloaded
from shared.tokenizer import Tokenizer

VALID = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name"]})


def _slow_schema(tag: str, n: int = 160) -> str:
    """~3 s of xgrammar compile on a 2-core CI machine (64 properties took 0.5 s there: timing-dependent against a
    1 s deadline), below the cache's size limit."""
    props = {f"{tag}{i}": {"type": "object", "properties": {
        f"s{j}": {"type": ["string", "integer", "null"], "pattern": "^[a-z]{3,9}$"} for j in range(20)}}
        for i in range(n)}
    return json.dumps({"type": "object", "properties": props})


async def test_slow_schemas_do_not_poison_the_pool():
    cache = GrammarCache(Tokenizer.load("tiny-random"), max_threads=2)
    try:
        # Two slow schemas take both threads of the pool.
        slow = [asyncio.create_task(cache.compile_async("json_schema", _slow_schema(t), timeout_s=0.5))
                for t in ("a", "b")]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        assert await cache.compile_async("json_schema", VALID, timeout_s=5.0) is not None  # during them
        during = time.monotonic() - t0
        for task in slow:
            with pytest.raises(InvalidRequest, match="longer than"):
                await task
        t0 = time.monotonic()
        other = json.dumps({"type": "array", "items": {"type": "integer"}})
        assert await cache.compile_async("json_schema", other, timeout_s=5.0) is not None  # right after
        after = time.monotonic() - t0
        assert during < 5.0 and after < 2.0, (during, after)
        assert cache.pool_replacements >= 1
        # The slow one stays refused without another compile.
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest, match="longer than"):
            await cache.compile_async("json_schema", _slow_schema("a"), timeout_s=5.0)
        assert time.monotonic() - t0 < 0.1
    finally:
        cache.close()


def test_too_many_abandoned_compiles_refuse_new_grammars_fast():
    cache = GrammarCache(Tokenizer.load("tiny-random"), max_threads=1, max_abandoned=1)
    try:
        with pytest.raises(InvalidRequest, match="longer than"):
            cache.compile("json_schema", _slow_schema("c"), timeout_s=0.3)
        if cache._abandoned:  # still running in the background: new work is refused, not queued
            with pytest.raises(Overloaded, match="busy"):
                cache.compile("regex", "[a-z]+x", timeout_s=5)
    finally:
        cache.close()


def test_a_busy_refusal_is_not_remembered():
    """Busy is the server's state, not the grammar's fault: once the abandoned compiles end, the same grammar
    compiles (it was not put among the rejected ones)."""
    cache = GrammarCache(Tokenizer.load("tiny-random"), max_threads=1, max_abandoned=1)
    try:
        stuck = ("regex", "a stand-in for a compile still running")
        cache._abandoned.add(stuck)
        with pytest.raises(Overloaded, match="busy") as refused:
            cache.compile("regex", "[a-z]+y", timeout_s=5)
        assert not isinstance(refused.value, InvalidRequest) and not cache._rejected
        cache._abandoned.discard(stuck)  # the abandoned compile ended
        assert cache.compile("regex", "[a-z]+y", timeout_s=5) is not None
    finally:
        cache.close()
