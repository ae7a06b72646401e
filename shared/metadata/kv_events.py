"""KV events: each worker tells Redis which prefix blocks its radix tree holds, so that every gateway routes on
the same exact picture (shared/metadata/kv_index.py reads them).

A block is BLOCK_TOKENS tokens of a prompt, named by a 64-bit hash chained over every block before it and
the tenant salt (`block_chain`): one name stands for a whole prefix, and the worker and every gateway name
it alike. A worker holds block k of a cached path when the path's tokens reach the block's end, so a
stored leaf adds the blocks ending inside it and an evicted leaf removes them (a split changes nothing).

The publisher is the radix tree's listener (shared/cache/radix_cache.py). On the engine thread it only
appends the path's tokens to a bounded buffer (past the bound it drops everything and asks for a resync),
and the first event of a burst wakes the event loop at once (one call_soon_threadsafe per batch) and yields
its core to it (one sched_yield: on busy cores the loop thread would wait behind the engine's). The
event loop hashes, nets a burst of events into one `KvBatch` and XADDs it to the worker's own stream
(MAXLEN-trimmed), numbered by `seq` within an `epoch` (one per worker start: its first batch clears what
readers knew). It keeps a mirror of the worker's block set and writes it as a snapshot
key (with its seq and stream id) about once a second when it changed, so a reader can start or catch up. A
batch lost to a Redis outage, an overflow or a FLUSHALL (the snapshot key vanishes) is answered by a fresh
snapshot and a `resync` marker. Every entry is signed with the internal key (HMAC-SHA256), when there is one.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict, deque
from typing import Callable, Sequence

import msgspec

from shared.knobs import knob
from shared.metadata.outage import Outage

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # the gateway's routing block too: one naming everywhere
KV_STREAM_MAXLEN = knob("KV_STREAM_MAXLEN")
KV_SNAPSHOT_S = knob("KV_SNAPSHOT_S")
KV_EVENT_BUFFER = knob("KV_EVENT_BUFFER")
TURN_S = 0.1  # the loop's turn when no event wakes it (the snapshot's check, a stop)


@functools.lru_cache(maxsize=4096)
def salt_seed(salt: str | None) -> int:
    """The chain's start for a tenant: the same in every process (Python's str hash is seeded per process)."""
    return int.from_bytes(hashlib.blake2b((salt or "").encode(), digest_size=8).digest(), "little", signed=True)


def block_chain(input_ids: Sequence[int], block: int, salt: str | None,
                known: list[int] | None = None) -> list[int]:
    """Chained names of the prompt's full blocks (about 6 us for 512 tokens). `known`: the names of the
    leading blocks, already computed (a finished request's prompt): only the rest is hashed.

    A name is CPython's 64-bit tuple hash of (previous name, the block's ids): several times cheaper than a
    cryptographic digest per block, and the same in every process of one CPython version (ints hash to
    themselves, the salt's seed is a digest); a collision can only send a request to a worker that turns out
    not to hold its prefix, never change what it computes."""
    names = list(known) if known else []
    h = names[-1] if names else salt_seed(salt)
    start = len(names) * block
    ids = iter(input_ids) if not start else itertools.islice(input_ids, start, None)
    append = names.append
    for blk in zip(*(ids,) * block):  # the full blocks' ids as tuples, cut in C (a trailing part is left out)
        h = hash((h, blk))
        append(h)
    return names


class WorkerLoad(msgspec.Struct, array_like=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class KvBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One stream entry: the net change of a burst of tree events. A reader applies `clear`, then
    `removed`, then `stored`; `resync` says events were lost and the snapshot must be read again."""
    worker: str
    epoch: str
    seq: int
    ts: float  # wall time of the burst's first event (for the readers' lag)
    stored: list[int] = []
    removed: list[int] = []
    clear: bool = False
    resync: bool = False
    load: WorkerLoad | None = None


class KvSnapshot(msgspec.Struct, array_like=True):
    """A worker's whole block set as of batch `seq`, whose stream entry is `stream_id`."""
    worker: str
    epoch: str
    seq: int
    stream_id: str
    blocks: list[int]


_encode = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(KvBatch).decode
_decode_snapshot = msgspec.msgpack.Decoder(KvSnapshot).decode


class BadEvent(ValueError):
    pass


def sign(payload: bytes, key: str) -> bytes:
    return hmac.new(key.encode(), payload, hashlib.sha256).digest()[:16] if key else b""


def seal(msg: KvBatch | KvSnapshot, key: str) -> bytes:
    """The signed bytes of a batch or snapshot: 16 bytes of HMAC (none without a key), then msgpack."""
    payload = _encode(msg)
    return sign(payload, key) + payload


def unseal(raw: bytes, key: str, snapshot: bool = False) -> KvBatch | KvSnapshot:
    """The message in `raw`, or BadEvent("unauthenticated" | "malformed")."""
    if not isinstance(raw, bytes):
        raise BadEvent("malformed")
    n = 16 if key else 0
    if len(raw) < n or not hmac.compare_digest(raw[:n], sign(raw[n:], key)):
        raise BadEvent("unauthenticated")
    try:
        return (_decode_snapshot if snapshot else _decode_batch)(raw[n:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise BadEvent("malformed") from None


def stream_key(prefix: str, worker: str) -> str:
    return f"{prefix}:kv:{worker}"


def snapshot_key(prefix: str, worker: str) -> str:
    return f"{prefix}:kvsnap:{worker}"


class _ChainMemo:
    """Block names of paths seen lately, so that a path extending one (a conversation's next turn, an output
    after its prompt, an eviction of what was stored) hashes only its new blocks: the name of a path's last
    full block, keyed by the 64-bit hash of its tokens' bytes up to there (hashing bytes in C is many times
    cheaper than naming the blocks; a collision costs a wrong name, i.e. a routing miss, never an error)."""

    def __init__(self, capacity: int = 16384):
        self.capacity = capacity
        self._last: OrderedDict[tuple, int] = OrderedDict()

    def names(self, namespace: str | None, tokens, start: int) -> list[int]:
        """Names of the blocks of `tokens` (a numpy path) that end past token `start`."""
        first = start // BLOCK_TOKENS  # the first block ending past start
        n = tokens.shape[0] // BLOCK_TOKENS
        if first >= n:
            return []
        h = salt_seed(namespace) if first == 0 else self._last.get(
            (namespace, hash(tokens[:first * BLOCK_TOKENS].tobytes())))
        if h is None:  # not seen: name the blocks before too
            names = block_chain(tokens[:n * BLOCK_TOKENS].tolist(), BLOCK_TOKENS, namespace)
            out = names[first:]
        else:
            ids = iter(tokens[first * BLOCK_TOKENS:n * BLOCK_TOKENS].tolist())
            out = []
            for blk in zip(*(ids,) * BLOCK_TOKENS):
                h = hash((h, blk))
                out.append(h)
        memo = self._last
        memo[(namespace, hash(tokens[:n * BLOCK_TOKENS].tobytes()))] = out[-1]
        if len(memo) > self.capacity:
            memo.popitem(last=False)
        return out


class KvEventPublisher:
    """A worker's KV events to Redis. `stored`/`removed`/`cleared` are the radix tree's listener, called on the
    engine thread; `run` is the event loop's task. `call_engine` runs a function on the engine thread
    between steps (a resync after an overflow lists the tree there); `load` reads the worker's load."""

    def __init__(self, redis, worker_id: str, key: str, call_engine: Callable,
                 load: Callable[[], WorkerLoad] | None = None, prefix: str = "radixserve",
                 buffer_events: int | None = None, snapshot_s: float | None = None):
        self.redis = redis
        self.worker = worker_id
        self.key = key
        self.call_engine = call_engine
        self.load = load
        self.stream = stream_key(prefix, worker_id)
        self.snap_key = snapshot_key(prefix, worker_id)
        self.buffer_events = buffer_events or KV_EVENT_BUFFER
        self.snapshot_s = snapshot_s or KV_SNAPSHOT_S
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.blocks: set[int] = set()  # the mirror: what the tree holds as of self.seq
        self._events: deque = deque()  # (kind, namespace, tokens, start, wall time), appended on the engine thread
        self._overflow = False
        self._woken = False  # a wake is on its way to the loop (set on the engine thread, cleared on the loop)
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._need_snapshot = True  # a reader may need one we have not written (start, resync, changes)
        self._need_resync = False  # readers missed something: a snapshot and a resync marker are due
        self._last_id = "0-0"
        self.outage = Outage(f"worker {worker_id} KV events", log, base_s=0.1, max_s=0.5)
        self._cache = None
        self._memo = _ChainMemo()
        # listener_s: the engine thread's CPU time in the listener; cpu_s: the loop thread's in hashing and
        # netting (thread CPU clocks: time spent waiting for a core or the GIL is not the publisher's)
        self.stats = {"batches": 0, "events": 0, "dropped": 0, "resyncs": 0, "cpu_s": 0.0, "listener_s": 0.0}

    # ---- the radix tree's listener (engine thread) ------------------------------------------------
    def stored(self, node) -> None:
        """A leaf came into the tree: the blocks ending inside it are held now."""
        self._append("s", node)

    def removed(self, node, tier: str = "device") -> None:
        """A leaf left the tree (`tier`: where its KV was; a move to a host tier that still serves matches
        is no removal for routing and is not reported here)."""
        self._append("r", node)

    def cleared(self) -> None:
        self._append("c", None)

    def _append(self, kind: str, node) -> None:
        t0 = time.thread_time()
        if self._overflow:
            self.stats["dropped"] += 1
        elif len(self._events) >= self.buffer_events:
            self._overflow = True  # the loop will ask the engine for the whole set
            self.stats["dropped"] += 1
        else:
            ns, tokens, start = self._cache.path_of(node) if node is not None else (None, None, 0)
            self._events.append((kind, ns, tokens, start, time.time()))
        # The first event of a batch wakes the loop at once (one write to its self-pipe; the loop clears
        # `_woken` before it takes the buffer, so later events ride along): an event must not wait for the
        # step's outputs, which come after the next forward pass (the tree stores a pass's KV at launch).
        # Then this thread gives up its core and the GIL for a moment: where every core is
        # busy (CPU-bound engine threads), the woken loop thread would otherwise wait behind this one for the
        # scheduler, or for the GIL, through a forward pass or more; with a core idle it returns at once.
        if not self._woken and self._loop is not None:
            self._woken = True
            self._loop.call_soon_threadsafe(self._wake.set)
            os.sched_yield()
        self.stats["listener_s"] += time.thread_time() - t0

    # ---- the event loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Publish until cancelled: a clear for this epoch first, then batches as events come."""
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()  # (after _wake: the engine thread wakes through both)
        self._need_resync = True  # the first entry of an epoch: clear-all (readers drop the old epoch)
        snap_due = 0.0
        while not self._stopped:
            if not self._need_resync:  # (a resync goes at once: the first turn, or Redis back)
                try:  # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation)
                    async with asyncio.timeout(TURN_S):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self._wake.clear()
            self._woken = False
            try:
                async with asyncio.timeout(3.0):
                    if self._overflow:
                        await self._reload()
                    batch = self._take()
                    if self._need_resync:
                        await self._publish_resync(batch)
                    elif batch is not None:
                        await self._xadd(batch)
                    now = time.monotonic()
                    if now >= snap_due:
                        snap_due = now + self.snapshot_s
                        if not await self.redis.exists(self.snap_key):  # FLUSHALL, or the key lost
                            log.warning("worker %s: KV snapshot gone from Redis (FLUSHALL?): resyncing readers",
                                        self.worker)
                            await self._publish_resync(None)
                        elif self._need_snapshot:
                            await self._write_snapshot()
            except Exception as e:  # Redis away: the mirror stays exact; readers resync when it is back
                self._need_resync = True
                await asyncio.sleep(self.outage.failed(e))
                continue
            self.outage.ok()

    def _take(self) -> KvBatch | None:
        """Net the buffered events into the mirror and one batch (None when there were none)."""
        events = self._events
        if not events:
            return None
        t0 = time.thread_time()
        stored: set[int] = set()
        removed: set[int] = set()
        clear = False
        ts = events[0][4]
        n = 0
        while events:
            kind, ns, tokens, start, _ = events.popleft()
            n += 1
            if kind == "c":
                clear = True
                stored.clear()
                removed.clear()
                self.blocks.clear()
                continue
            names = self._memo.names(ns, tokens, start)
            if kind == "s":
                stored.update(names)
                removed.difference_update(names)
                self.blocks.update(names)
            else:
                removed.update(names)
                stored.difference_update(names)
                self.blocks.difference_update(names)
        self.stats["events"] += n
        self._need_snapshot = True
        batch = KvBatch(worker=self.worker, epoch=self.epoch, seq=self.seq + 1, ts=ts, stored=list(stored),
                        removed=list(removed), clear=clear, load=self._load())
        self.stats["cpu_s"] += time.thread_time() - t0
        return batch

    async def _xadd(self, batch: KvBatch) -> None:
        entry_id = await self.redis.xadd(self.stream, {"m": seal(batch, self.key)}, maxlen=KV_STREAM_MAXLEN,
                                         approximate=True)
        self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        self.seq = batch.seq
        self.stats["batches"] += 1

    async def _publish_resync(self, batch: KvBatch | None) -> None:
        """Readers lost track: a marker (carrying the buffered changes, which the mirror has) and, before any
        reader acts on it, the snapshot it points them to."""
        marker = KvBatch(worker=self.worker, epoch=self.epoch, seq=self.seq + 1,
                         ts=batch.ts if batch is not None else time.time(), resync=True,
                         clear=self.seq == 0, load=self._load())
        await self._xadd(marker)
        await self._write_snapshot()
        self._need_resync = False
        self.stats["resyncs"] += 1

    async def _write_snapshot(self) -> None:
        snap = KvSnapshot(worker=self.worker, epoch=self.epoch, seq=self.seq, stream_id=self._last_id,
                          blocks=list(self.blocks))
        await self.redis.set(self.snap_key, seal(snap, self.key))
        self._need_snapshot = False

    async def _reload(self) -> None:
        """The buffer overflowed: rebuild the mirror from the tree itself (the engine thread lists its paths
        and empties the buffer between two steps), and have readers resync."""
        def dump():
            self._events.clear()
            self._overflow = False
            leaves = (n for n in self._cache.nodes() if not n.children)
            return [self._cache.path_of(leaf)[:2] for leaf in leaves]

        paths = await asyncio.wrap_future(self.call_engine(dump))
        blocks: set[int] = set()
        for ns, tokens in paths:
            blocks.update(self._memo.names(ns, tokens, 0))
        self.blocks = blocks
        self._need_resync = True
        log.warning("worker %s: KV event buffer overflowed (%d events dropped): resyncing readers",
                    self.worker, self.stats["dropped"])

    def _load(self) -> WorkerLoad | None:
        try:
            return self.load() if self.load is not None else None
        except Exception:  # the engine's figures read from another thread mid-change: none this time
            return None

    def stop(self) -> None:
        """`run` returns at its next turn (a cancellation alone can be swallowed inside the Redis client)."""
        self._stopped = True

    def attach(self, cache) -> bool:
        """Listen to `cache` (a radix tree; False for a cache without one, e.g. --disable-radix-cache)."""
        if not hasattr(cache, "listener"):
            return False
        self._cache = cache
        cache.listener = self
        return True
