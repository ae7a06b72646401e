"""The exact routing index: per worker, the prefix blocks its radix tree holds, followed from the workers' KV
event streams in Redis (shared/metadata/kv_events.py writes them).

`KvIndex` is the picture a routing policy reads (on the event loop, no locks: the reader runs there too).
`KvIndexReader` keeps it: it learns the workers and their addresses from the registry, seeds each picture
from the worker's snapshot, then follows the worker's stream (XREAD, blocking on its own task), checking
that every batch is the next of its epoch. A gap, a resync marker, a lost stream or snapshot (FLUSHALL) or
Redis going away makes a picture unsynced until a snapshot at least as new as what was missed is read
(the worker writes one within a second); meanwhile callers fall back to their own approximate index.
Entries that are unsigned or signed with another key, that name another worker than their stream's,
or that do not decode are ignored and counted; nothing read from Redis can stop the reader.
Each picture also remembers when (the worker's clock) its latest removals happened, so that the routing
policy can tell a request routed on a prefix already gone (a stale index) from one evicted after the pick.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict, deque
from typing import Sequence

from shared.metadata.kv_events import BadEvent, KvBatch, KvSnapshot, WorkerLoad, snapshot_key, stream_key, unseal
from shared.metadata.outage import Outage

log = logging.getLogger(__name__)

_REGISTRY_S = 1.0  # how often the registry is read (workers coming and going)
_FORGET_S = 60.0  # a picture whose worker has had no registry entry this long is dropped
_BLOCK_MS = 200  # XREAD's wait: bounds how late a new worker or a resync is picked up
_LAGS = 4096  # recent event lags kept for the p99
_LOAD_FRESH_S = 1.0  # a worker's published load older than this is not used
_REMOVALS = 16384  # per worker, the latest block removals kept with their time (`removed_at`)


class Picture:
    __slots__ = ("worker", "address", "blocks", "epoch", "seq", "last_id", "synced", "want", "load", "load_at", "seen",
                 "removed_at")

    def __init__(self, worker: str, address: str):
        self.worker = worker
        self.address = address
        self.blocks: set[int] = set()
        self.epoch = ""
        self.seq = 0
        self.last_id = "0-0"
        self.synced = False
        self.want: tuple[str, int] | None = None  # (epoch, seq): an older snapshot cannot resync the picture
        self.load: WorkerLoad | None = None
        self.load_at = 0.0  # when `load` arrived (monotonic): it rides on cache changes, and ages out
        self.seen = time.monotonic()  # last time the registry listed the worker
        # block -> the worker's wall time of the batch that last removed it (its first event's: no later than
        # the removal), the latest _REMOVALS: whether a prefix a request was routed on was gone before then
        self.removed_at: OrderedDict[int, float] = OrderedDict()


class KvIndex:
    def __init__(self):
        self.pictures: dict[str, Picture] = {}  # worker id -> picture
        self.by_address: dict[str, Picture] = {}
        self.up = False  # the reader is connected to Redis
        self.lags: deque[float] = deque(maxlen=_LAGS)
        self.counts = {"batches": 0, "resyncs": 0, "gaps": 0, "rejected_unauthenticated": 0,
                       "rejected_unknown_worker": 0, "rejected_malformed": 0}

    def synced(self, addresses: Sequence[str]) -> bool:
        """Whether the exact picture of every one of these workers is current."""
        if not self.up:
            return False
        by = self.by_address
        for a in addresses:
            p = by.get(a)
            if p is None or not p.synced:
                return False
        return True

    def match(self, address: str, chain: Sequence[int]) -> int:
        """Leading blocks of `chain` the worker at `address` holds."""
        p = self.by_address.get(address)
        if p is None:
            return 0
        blocks = p.blocks
        n = 0
        for name in chain:
            if name not in blocks:
                break
            n += 1
        return n

    def removed_at(self, address: str, name: int) -> float | None:
        """The worker's wall time of the batch that last removed block `name` from the worker at `address`
        (no later than the removal itself), or None when no removal of it is known (too old, or none)."""
        p = self.by_address.get(address)
        return p.removed_at.get(name) if p is not None else None

    def queued(self, address: str) -> int:
        """Requests the worker last said it was running or holding in its queue (every gateway's)."""
        p = self.by_address.get(address)
        if p is None or p.load is None or time.monotonic() - p.load_at > _LOAD_FRESH_S:
            return 0  # nothing recent: a worker whose cache stopped changing may have gone idle since
        return p.load.running + p.load.waiting

    def stats(self) -> dict:
        lags = sorted(self.lags)
        p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else 0.0
        p50 = lags[len(lags) // 2] if lags else 0.0
        return {"connected": self.up, "workers": len(self.pictures),
                "synced_workers": sum(p.synced for p in self.pictures.values()),
                "blocks": sum(len(p.blocks) for p in self.pictures.values()),
                "event_lag_p50_s": round(p50, 6), "event_lag_p99_s": round(p99, 6), "event_lag_samples": len(lags),
                **self.counts}

    # ---- updates (the reader's) ----------------------------------------------------------------
    def unsync(self, p: Picture, want: tuple[str, int] | None = None) -> None:
        p.synced = False
        if want is not None:
            p.want = want

    @staticmethod
    def _note_removed(p: Picture, names, ts: float) -> None:
        removed = p.removed_at
        for name in names:
            removed[name] = ts
            removed.move_to_end(name)
        while len(removed) > _REMOVALS:
            removed.popitem(last=False)

    def adopt(self, p: Picture, snap: KvSnapshot) -> bool:
        """Seed `p` from a snapshot; False when it is older than what the picture has to catch up with."""
        if p.want is not None and (snap.epoch != p.want[0] or snap.seq < p.want[1]):
            return False
        p.blocks = set(snap.blocks)
        p.epoch, p.seq, p.last_id = snap.epoch, snap.seq, snap.stream_id
        p.synced, p.want = True, None
        self.counts["resyncs"] += 1
        return True

    def apply(self, p: Picture, b: KvBatch) -> None:
        """One stream entry of p's worker, in order."""
        self.counts["batches"] += 1
        if b.load is not None:
            p.load, p.load_at = b.load, time.monotonic()
        fresh_epoch = b.epoch != p.epoch and b.seq == 1 and b.clear  # the worker (re)started
        if fresh_epoch:
            p.blocks = set()
            p.epoch, p.seq, p.want = b.epoch, 1, None
            p.synced = True
            return
        if not p.synced:
            return
        if b.epoch != p.epoch or b.seq != p.seq + 1:
            self.counts["gaps"] += 1
            self.unsync(p, (b.epoch, b.seq))
            return
        p.seq = b.seq
        if b.resync:  # the worker lost batches: only its snapshot of this seq or later says what it holds
            self.unsync(p, (b.epoch, b.seq))
            return
        blocks = p.blocks
        if b.clear:
            self._note_removed(p, blocks, b.ts)
            blocks.clear()
        blocks.difference_update(b.removed)
        self._note_removed(p, b.removed, b.ts)
        blocks.update(b.stored)
        self.lags.append(max(0.0, time.time() - b.ts))


class KvIndexReader:
    """Keeps a KvIndex from Redis until cancelled (`run`). `key`: the internal key entries are signed with."""

    def __init__(self, url: str, key: str, index: KvIndex | None = None, prefix: str = "radixserve"):
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)
        self.key = key
        self.prefix = prefix
        self.index = index or KvIndex()
        self.outage = Outage("KV index", log, base_s=0.1, max_s=0.5)
        self._registry_due = 0.0
        self._stopped = False

    def stop(self) -> None:
        """`run` returns at its next turn (a cancellation alone can be swallowed inside the Redis client)."""
        self._stopped = True

    async def close(self) -> None:
        await self.redis.aclose()

    async def run(self) -> None:
        idx = self.index
        while not self._stopped:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away (or a bug in what it returned): every picture is stale
                idx.up = False
                for p in idx.pictures.values():
                    idx.unsync(p)
                self._registry_due = 0.0
                await asyncio.sleep(self.outage.failed(e))
                continue
            if self.outage.ok() or not idx.up:
                idx.up = True

    async def step(self) -> None:
        """Read the registry when due, resync what needs it, then wait for entries (at most _BLOCK_MS)."""
        idx = self.index
        now = time.monotonic()
        if now >= self._registry_due:
            self._registry_due = now + _REGISTRY_S
            await self._read_registry()
        for p in list(idx.pictures.values()):
            if not p.synced:
                await self._resync(p)
        following = {stream_key(self.prefix, p.worker): p for p in idx.pictures.values() if p.synced}
        if not following:
            await asyncio.sleep(_BLOCK_MS / 1000)
            return
        reply = await self.redis.xread({k: p.last_id for k, p in following.items()}, block=_BLOCK_MS,
                                       count=1000)
        for stream, entries in reply or ():
            p = following.get(stream.decode() if isinstance(stream, bytes) else stream)
            if p is None:
                continue
            for entry_id, fields in entries:
                p.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._entry(p, fields)

    def _entry(self, p: Picture, fields) -> None:
        idx = self.index
        try:
            raw = fields.get(b"m") if isinstance(fields, dict) else None
            batch = unseal(raw, self.key)
        except BadEvent as e:
            idx.counts[f"rejected_{e}"] += 1
            return
        if batch.worker != p.worker:
            idx.counts["rejected_unknown_worker"] += 1
            return
        idx.apply(p, batch)

    async def _resync(self, p: Picture) -> None:
        raw = await self.redis.get(snapshot_key(self.prefix, p.worker))
        if raw is None:
            return  # gone (FLUSHALL, or the worker has not written one yet): it is rewritten within a second
        try:
            snap = unseal(raw, self.key, snapshot=True)
        except BadEvent as e:
            self.index.counts[f"rejected_{e}"] += 1
            return
        if snap.worker != p.worker:
            self.index.counts["rejected_unknown_worker"] += 1
            return
        self.index.adopt(p, snap)

    async def _read_registry(self) -> None:
        idx = self.index
        keys = [k async for k in self.redis.scan_iter(match=f"{self.prefix}:worker:*", count=100)]
        values = await self.redis.mget(keys) if keys else []
        now = time.monotonic()

        for key, raw in zip(keys, values):
            if raw is None:
                continue
            try:
                info = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(info, dict) or not info.get("kv_events"):
                continue
            worker = (key.decode() if isinstance(key, bytes) else key).rsplit(":", 1)[1]
            address = f"{info.get('host')}:{info.get('port')}"
            p = idx.pictures.get(worker)
            if p is None:
                p = idx.pictures[worker] = Picture(worker, address)
            elif p.address != address:
                idx.by_address.pop(p.address, None)
                p.address = address
            idx.by_address[address] = p
            p.seen = now
        for worker, p in list(idx.pictures.items()):
            if now - p.seen > _FORGET_S:
                del idx.pictures[worker]
                if idx.by_address.get(p.address) is p:
                    del idx.by_address[p.address]
