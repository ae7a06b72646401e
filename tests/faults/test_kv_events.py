"""KV events through a real redis-server: a worker's radix tree (published by shared/metadata/kv_events.py)
and a gateway's exact index (shared/metadata/kv_index.py) agree block for block, through evictions, a
gap, a FLUSHALL, a Redis outage and an overflowing buffer; forged, foreign and malformed entries are
counted and change nothing."""
from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import Future

import pytest
import redis
import redis.asyncio as aioredis

from services.gateway.routing.cache_aware import CacheAwarePolicy
from shared.cache.allocator import SlotAllocator
from shared.cache.radix_cache import RadixCache
from shared.metadata import kv_events
from shared.metadata.kv_events import BLOCK_TOKENS, KvBatch, KvEventPublisher, block_chain, seal, sign, stream_key
from shared.metadata.kv_index import KvIndex, KvIndexReader
from tests.support.stack import RedisServer

pytestmark = pytest.mark.e2e
KEY = "internal-secret"


@pytest.fixture(scope="module")
def own_redis():
    """This module's own redis-server: the outage test stops and restarts it."""
    server = RedisServer()
    yield server
    server.stop()


def tree_blocks(cache: RadixCache) -> set[int]:
    """Every block the tree holds, named from scratch."""
    out: set[int] = set()
    for node in cache.nodes():
        if not node.children:
            ns, tokens, _ = cache.path_of(node)
            out.update(block_chain(tokens.tolist(), BLOCK_TOKENS, ns))
    return out


def run_now(fn) -> Future:
    fut: Future = Future()
    fut.set_result(fn())
    return fut


class Rig:
    """A radix tree with a publisher, and a reader's index, in one event loop."""

    def __init__(self, url: str, worker: str = "w1", buffer_events: int = 65536, pages: int = 4096):
        self.url = url
        self.worker = worker
        self.alloc = SlotAllocator(pages, 1, "cpu")
        self.cache = RadixCache(self.alloc, 1)
        self.pub = KvEventPublisher(aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=0.5),
                                    worker, KEY, run_now, buffer_events=buffer_events, snapshot_s=0.2)
        assert self.pub.attach(self.cache)
        self.reader = KvIndexReader(url, KEY)
        self.index: KvIndex = self.reader.index
        self.sync = redis.Redis.from_url(url)
        self.rng = random.Random(0)

    def register(self) -> None:
        self.sync.set(f"radixserve:worker:{self.worker}",
                      json.dumps({"host": "127.0.0.1", "port": 1, "role": "unified", "kv_events": True}))

    async def __aenter__(self):
        self.sync.flushall()
        self.register()
        self.tasks = [asyncio.create_task(self.pub.run()), asyncio.create_task(self.reader.run())]
        return self

    async def __aexit__(self, *exc):
        self.pub.stop()
        self.reader.stop()
        for t in self.tasks:
            t.cancel()
        done, pending = await asyncio.wait(self.tasks, timeout=5)
        assert not pending, "a KV events task ignored its cancellation"
        await self.reader.close()

    def insert(self, n: int = 5, namespace: str | None = None) -> None:
        for _ in range(n):
            base = [1, 2, 3] * 20 if self.rng.random() < 0.5 else []
            tokens = base + [self.rng.randrange(1000) for _ in range(self.rng.randrange(10, 90))]
            slots = self.alloc.alloc(len(tokens))
            if slots is None:
                self.cache.evict(len(tokens))
                slots = self.alloc.alloc(len(tokens))
            done = self.cache.insert(tokens, slots, namespace)
            self.alloc.free(slots[:done])

    @property
    def picture(self):
        return self.index.pictures.get(self.worker)

    async def converged(self, timeout: float = 3.0) -> float:
        """Seconds until the index holds exactly the tree's blocks, synced."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            p = self.picture
            if p is not None and p.synced and self.index.up and p.blocks == tree_blocks(self.cache):
                return time.monotonic() - t0
            await asyncio.sleep(0.01)
        p = self.picture
        raise AssertionError(f"index not converged: synced={p and p.synced} up={self.index.up} "
                             f"stats={self.index.stats()} pub={self.pub.stats}")


def with_rig(url: str, body, warm: int = 5, **kw) -> None:
    """body(rig) on a rig whose index already holds `warm` stored prompts."""
    async def main():
        async with Rig(url, **kw) as rig:
            rig.insert(warm)
            await rig.converged()
            await body(rig)
    asyncio.run(main())


def test_index_follows_stores_evictions_tenants_and_flush(own_redis):
    async def main():
        async with Rig(own_redis.url, pages=600) as rig:
            rig.insert(10)
            rig.insert(5, namespace="tenant-a")
            await rig.converged()
            assert rig.index.stats()["blocks"] > 0
            rig.cache.evict(300)
            rig.insert(10)  # more evictions, through a full pool
            await rig.converged()
            # The routing policy, on the exact index, finds what the tree holds and nothing it dropped.
            p = rig.picture
            policy = CacheAwarePolicy(exact=rig.index)
            node = next(n for n in rig.cache.nodes() if not n.children)
            ns, tokens, _ = rig.cache.path_of(node)
            chain = block_chain(tokens.tolist(), BLOCK_TOKENS, ns)
            assert rig.index.match(p.address, chain) == len(chain)
            assert rig.index.synced([p.address]) and policy.exact is rig.index
            assert rig.index.match(p.address, block_chain(tokens.tolist(), BLOCK_TOKENS, "other")) == 0
            rig.cache.reset()
            await rig.converged()
            assert not rig.picture.blocks
            assert rig.index.stats()["event_lag_p99_s"] < 1.0
    asyncio.run(main())


def test_the_first_event_of_a_batch_wakes_the_publisher_and_the_rest_ride_along(own_redis, monkeypatch):
    """An event reaches Redis without waiting for the loop's own turn (made 30 s here), and the engine
    thread wakes the loop once per batch, not once per event."""
    monkeypatch.setattr(kv_events, "TURN_S", 30.0)

    async def body(rig):
        loop, wakes = rig.pub._loop, []

        class Counting:  # the event loop as the listener sees it
            def call_soon_threadsafe(self, fn, *args):
                wakes.append(fn)
                return loop.call_soon_threadsafe(fn, *args)

        rig.pub._loop = Counting()
        y0 = len(yields)
        for n in (1, 2):
            batches = rig.pub.stats["batches"]
            rig.insert(4)  # no turn of the loop can come between these four
            assert len(wakes) == n and len(yields) - y0 == n  # the engine thread gave up its core once a batch
            await rig.converged()
            assert rig.pub.stats["batches"] == batches + 1

    yields = []
    monkeypatch.setattr(kv_events.os, "sched_yield", lambda: yields.append(1))
    with_rig(own_redis.url, body)


def test_forged_foreign_and_malformed_entries_are_counted_and_ignored(own_redis):
    async def body(rig):
        before = set(rig.picture.blocks)
        seq = rig.pub.seq
        stream = stream_key("radixserve", "w1")
        bogus = KvBatch(worker="w1", epoch=rig.pub.epoch, seq=seq + 1, ts=time.time(), stored=[1, 2, 3])
        rig.sync.xadd(stream, {"m": seal(bogus, "wrong-key")})  # not signed with the internal key
        foreign = KvBatch(worker="w9", epoch=rig.pub.epoch, seq=seq + 1, ts=time.time(), stored=[4])
        rig.sync.xadd(stream, {"m": seal(foreign, KEY)})  # an id the stream's owner is not
        rig.sync.xadd(stream, {"m": sign(b"\xc1garbage", KEY) + b"\xc1garbage"})  # signed, undecodable
        rig.sync.xadd(stream, {"x": b"no payload"})
        await asyncio.sleep(0.4)
        c = rig.index.counts
        assert c["rejected_unauthenticated"] == 1 and c["rejected_unknown_worker"] == 1
        assert c["rejected_malformed"] == 2
        assert rig.picture.synced and rig.picture.blocks == before
        rig.insert(3)  # the real worker's next batch still applies
        await rig.converged()
    with_rig(own_redis.url, body)


def test_gap_and_flushall_are_resynced(own_redis):
    async def body(rig):
        # A gap: the reader away while one of the worker's entries is lost (a trimmed or damaged stream).
        rig.reader.stop()
        rig.tasks[1].cancel()
        await asyncio.wait([rig.tasks[1]], timeout=5)
        await rig.reader.close()
        seq = rig.pub.seq
        rig.insert(2)
        while rig.pub.seq == seq:
            await asyncio.sleep(0.01)
        last = rig.sync.xrevrange(stream_key("radixserve", "w1"), count=1)[0][0]
        rig.sync.xdel(stream_key("radixserve", "w1"), last)
        rig.insert(2)
        rig.reader = KvIndexReader(own_redis.url, KEY, index=rig.index)  # back, where the last one stopped
        rig.tasks[1] = asyncio.create_task(rig.reader.run())
        await rig.converged()
        assert rig.index.counts["gaps"] == 1
        resyncs = rig.index.counts["resyncs"]
        # FLUSHALL: stream, snapshot and registry entry gone; the worker rewrites its snapshot with a resync
        # marker, its next beat re-registers it.
        rig.sync.flushall()
        rig.insert(3)
        rig.register()
        t0 = time.monotonic()
        while rig.pub.stats["resyncs"] < 2 and time.monotonic() - t0 < 2:  # start, then the FLUSHALL
            await asyncio.sleep(0.01)
        assert rig.pub.stats["resyncs"] == 2
        await rig.converged()
        assert rig.index.counts["resyncs"] >= resyncs
    with_rig(own_redis.url, body)


def test_redis_outage_then_resync_within_two_seconds(own_redis):
    async def body(rig):
        own_redis.stop()
        t0 = time.monotonic()
        while rig.index.up and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        assert not rig.index.up and not rig.index.synced([rig.picture.address])  # callers fall back
        rig.insert(5)  # the tree moves on while the stream is away
        own_redis.start()  # empty: an outage that also lost everything
        rig.register()
        assert await rig.converged(timeout=2.0) < 2.0
    with_rig(own_redis.url, body)


def test_overflowing_buffer_drops_to_a_resync(own_redis):
    async def body(rig):
        rig.insert(20)  # more events than the buffer holds before the loop runs
        assert rig.pub.stats["dropped"] > 0
        await rig.converged()
        assert rig.pub.stats["resyncs"] >= 2
    with_rig(own_redis.url, body, warm=0, buffer_events=4)


def test_block_names_are_the_same_in_every_process():
    import subprocess
    import sys

    ids = list(range(40))
    code = ("from shared.metadata.kv_events import block_chain; "
            f"print(block_chain({ids!r}, 16, 'tenant'))")
    env = {"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}
    import os
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_chain(ids, 16, "tenant"))


def synced_index(*addresses: str) -> tuple[list, KvIndex]:
    """Stand-in workers (an address, no load) and an exact index of them, connected and synced, empty."""
    from shared.metadata.kv_index import Picture

    class W:
        def __init__(self, address):
            self.address, self.load = address, 0

    workers = [W(a) for a in addresses]
    index = KvIndex()
    index.up = True
    for w in workers:
        p = index.pictures[w.address] = index.by_address[w.address] = Picture(w.address, w.address)
        p.synced = True
    return workers, index


def test_policy_routes_on_the_exact_index_while_it_is_current_and_says_when_it_switches(caplog):
    """Synced: the longest prefix a worker really holds wins, whatever this process sent where; not synced
    (Redis away): the approximate index routes; one log line per switch."""
    (a, b), index = synced_index("a:1", "b:1")
    prompt = list(range(64))
    chain = block_chain(prompt, BLOCK_TOKENS, None)
    index.by_address["b:1"].blocks.update(chain[:3])  # b holds 3 of the 4 blocks (another gateway sent it)
    policy = CacheAwarePolicy(exact=index)
    policy.remember(a, prompt, None)  # this process believes a holds all 4 (a has since evicted them)
    with caplog.at_level("WARNING"):
        assert policy.pick([a, b], prompt, None) is b and policy.last_match_tokens == 48
        assert policy.pick([a, b], list(prompt), None) is b
        index.up = False  # Redis away: back to what this process knows
        assert policy.pick([a, b], list(prompt), None) is a
        index.up = True
        policy.pick([a, b], list(prompt), None)
    switches = [r.message for r in caplog.records if "cache-aware routing now" in r.message]
    assert len(switches) == 3  # exact, approximate, exact
    assert policy.stats()["decisions"] == {"exact/cache": 3, "approximate/cache": 1}


def test_a_prefix_evicted_before_the_pick_is_a_stale_route_and_one_evicted_after_is_not(monkeypatch):
    """A cache pick whose worker then finds less cached than promised counts against the index only when
    the worker's events date the missing block's removal before the pick (or do not know it); the same
    holds for the approximate index routing beside them (KV_INDEX_ROUTING off), which they audit."""
    from services.gateway.routing import cache_aware

    (a, b), index = synced_index("a:1", "b:1")
    seq = iter(range(1, 100))

    def batch(address, t, stored=(), removed=()):
        index.apply(index.by_address[address], KvBatch(worker=address, epoch="", seq=next(seq), ts=t,
                                                       stored=list(stored), removed=list(removed)))

    policy = CacheAwarePolicy(exact=index)
    prompts = [[c] * 8 + list(range(56)) for c in range(4)]  # 4 blocks each, no block shared
    chains = [block_chain(p, BLOCK_TOKENS, None) for p in prompts]
    for chain in chains:
        batch("a:1", time.time(), stored=chain)
    picked = []
    for prompt in prompts:
        assert policy.pick([a, b], prompt, None) is a and policy.last_match_tokens == 64
        picked.append(time.time())
    batch("a:1", picked[0] - 0.05, removed=chains[0][2:])  # evicted 50 ms before its pick: the index was stale
    batch("a:1", picked[1] + 0.05, removed=chains[1][2:])  # evicted after its pick, while the request queued
    batch("a:1", picked[2] - 0.01, removed=chains[2][2:])  # 10 ms before
    for prompt in prompts[:3]:  # the worker found 2 of the 4 blocks
        policy.remember(a, prompt + [1, 2], None, prompt=prompt, cached_tokens=32)
    policy.remember(a, prompts[3] + [1, 2], None, prompt=prompts[3], cached_tokens=63)  # all of it (one kept back)
    stats = policy.stats()
    assert (stats["cache_checked"], stats["cache_missed"], stats["cache_evicted_after"]) == (
        {"exact": 4}, {"exact": 2}, {"exact": 1})
    assert stats["exact_index"]["event_lag_samples"] == 7

    # The ablation: the approximate index routes while the exact one is current; a block whose removal the
    # events do not know counts against it too.
    monkeypatch.setattr(cache_aware, "KV_INDEX_ROUTING", False)
    policy = CacheAwarePolicy(exact=index)
    policy.remember(b, prompts[0], None)  # this process sent it to b, which never reported it
    assert policy.pick([a, b], prompts[0], None) is b
    policy.remember(b, prompts[0] + [1], None, prompt=prompts[0], cached_tokens=0)
    stats = policy.stats()
    assert stats["decisions"] == {"approximate/cache": 1} and stats["cache_missed"] == {"approximate": 1}


def test_host_tier_moves_are_kept_and_leaving_the_last_tier_is_a_removal(own_redis):
    """With a host tier (shared/cache/hiradix_cache.py), a block evicted from the device to the host still
    serves matches, so the index keeps it; one that leaves the host too is removed."""
    from tests.cache.test_hiradix_cache import make

    async def main():
        rig = Rig(own_redis.url)
        _, rig.alloc, rig.cache = make(device_tokens=256, host_tokens=512)
        assert rig.pub.attach(rig.cache)
        async with rig:
            for _ in range(6):
                rig.insert(5)  # past the device pool (evictions to the host) and past the host pool
                await rig.converged()
            assert rig.cache.stats()["evicted_tokens"] > 0
            assert any(n.value is None for n in rig.cache.nodes())  # host-only nodes, still in the index
    asyncio.run(main())
