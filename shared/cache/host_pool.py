"""The host tier's KV memory: a pool of token slots in host RAM (pinned when the device pool is on CUDA) and
the copies between it and the device pool (KVPool).

A host slot holds one token's KV of every layer, K and V: row `slot` of one [slots, 2 * layers, heads, dim]
buffer, so a run of consecutive host slots is one contiguous block and moves in one copy. The device pool is
one [2 * layers, slots, heads, dim] tensor (kv_pool.py), so its side of a transfer is one gather or scatter
over the slots of every layer.

On CUDA a transfer runs in chunks through two device staging buffers: the PCIe copies on one stream, the device
pool's gather or scatter on another, so one chunk crosses PCIe while the next is gathered (or the last one
scattered); writes and loads have streams and buffers of their own. It ends with an event the caller polls;
nothing here waits for the device. A transfer first waits (on the device) for the work queued on the compute
stream so far: a write must read KV the queued passes compute, and a load must not overwrite slots a queued pass
still touches. On the CPU the same copies run synchronously (no event: done on return).

Under tensor parallelism every rank has a host pool of its own KV heads, of the same slots and size (the flags'
sizes are per rank, as SGLang's); rank 0's tree decides every copy and each rank makes it for the same slots
(LeaderHostKVPool on rank 0, FollowerHostTier on the others).
"""
from __future__ import annotations

import logging
import os
import weakref

import numpy as np
import torch

from kernels.h2d import to_device
from shared.cache.allocator import SlotAllocator
from shared.cache.kv_pool import KVPool, as_bytes

log = logging.getLogger(__name__)

# Each of the two device staging buffers per direction: a transfer longer than this moves in chunks, pipelined.
STAGING_BYTES = 32 << 20


class HostTierError(ValueError):
    """The host tier cannot be set up as asked (its size against the host's memory)."""


def host_pool_tokens(device_tokens: int, bytes_per_token: int, ratio: float, size_gb: float,
                     available_bytes: int, ranks: int = 1) -> int:
    """Host slots for the tier of one rank (bytes_per_token: its KV shard's; every one of `ranks` tensor-parallel
    ranks on this host holds a pool of this size): size_gb GB a rank when > 0, as SGLang's --hicache-size (refused
    when the ranks' pools together pass 90% of the host's available memory), else ratio × the device pool's
    tokens, capped so that the ranks' pools together take at most half the available memory (with a warning)."""
    each = f" a rank × {ranks} ranks" if ranks > 1 else ""
    if size_gb > 0:
        tokens = int(size_gb * 1e9) // bytes_per_token
        if ranks * tokens * bytes_per_token > 0.9 * available_bytes:
            raise HostTierError(f"--hicache-size {size_gb} GB{each} is more than the host can pin: "
                                f"{available_bytes / 2**30:.1f} GiB of memory is available")
    else:
        tokens = int(device_tokens * ratio)
        cap = int(0.5 * available_bytes) // ranks // bytes_per_token
        if tokens > cap:
            log.warning("host KV tier: --hicache-ratio %s asks for %.1f GiB%s, capped at half the available host "
                        "memory (%.1f GiB%s); set --hicache-size (GB a rank) to choose", ratio,
                        tokens * bytes_per_token / 2**30, each, cap * bytes_per_token / 2**30, each)
            tokens = cap
    if tokens <= 0:
        raise HostTierError(f"the host KV tier would hold no tokens (--hicache-ratio {ratio}, --hicache-size "
                            f"{size_gb}, {available_bytes / 2**30:.1f} GiB of host memory available)")
    return tokens


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (the free physical pages where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_tokens: int):
        ps = device_pool.page_size
        self.device_pool = device_pool
        self.page_size = ps
        self.num_layers = device_pool.num_layers
        num_pages = max(1, num_tokens // ps)
        self.allocator = SlotAllocator(num_pages, ps, device="cpu")
        dev = device_pool.device
        self.cuda = dev.type == "cuda"
        sample = as_bytes(device_pool.k_buffers[0])
        self.row_shape = (2 * self.num_layers, device_pool.num_kv_heads, device_pool.head_dim)
        self.buffer = torch.empty(((num_pages + 1) * ps, *self.row_shape), dtype=sample.dtype)
        self.bytes_per_token = self.token_bytes(device_pool)
        if self.cuda:
            rows = max(1, STAGING_BYTES // self.bytes_per_token)
            # Per direction: (the PCIe copies' stream, the device pool side's stream) and two staging buffers.
            self._streams = {k: (torch.cuda.Stream(dev), torch.cuda.Stream(dev)) for k in ("write", "load")}
            _pin(self.buffer)
            # Unpinned when the pool goes (collected, or at exit), once its copies have ended: the memory is then
            # never freed under a copy, nor freed still registered (the driver keeps the range registered, and the
            # next pool given the same addresses could not pin them).
            weakref.finalize(self, _unpin, self.buffer, [s for pair in self._streams.values() for s in pair])
            self._staging = {k: [torch.empty((rows, *self.row_shape), dtype=sample.dtype, device=dev) for _ in range(2)]
                             for k in self._streams}
            self._freed = {k: [None, None] for k in self._streams}

    @staticmethod
    def token_bytes(device_pool: KVPool) -> int:
        """Host bytes of one token's KV (every layer, K and V)."""
        return (2 * device_pool.num_layers * device_pool.num_kv_heads * device_pool.head_dim
                * as_bytes(device_pool.k_buffers[0]).element_size())

    def size_tokens(self) -> int:
        return self.allocator.total_size()

    # ---- transfers ---------------------------------------------------------------------------------
    def write(self, device_slots: np.ndarray, host_slots: np.ndarray):
        """Copy the device pool's KV at device_slots into host_slots. Returns the CUDA event that marks its
        end, or None when it is done already (CPU)."""
        return self._transfer("write", np.asarray(device_slots, np.int64), np.asarray(host_slots, np.int64))

    def load(self, host_slots: np.ndarray, device_slots: np.ndarray):
        """Copy host_slots back into the device pool at device_slots. Event or None, as write()."""
        return self._transfer("load", np.asarray(device_slots, np.int64), np.asarray(host_slots, np.int64))

    def after(self, transfer: "Transfer") -> None:
        """Work queued from now on, on the compute stream and on this pool's copy streams, runs after `transfer`
        has ended: a wait on the device, not on the host (a tensor-parallel follower's side of rank 0 seeing its
        copy complete; FollowerHostTier)."""
        dev = self.device_pool.device
        torch.cuda.current_stream(dev).wait_event(transfer.done)
        for pair in self._streams.values():
            for stream in pair:
                stream.wait_event(transfer.done)

    def _transfer(self, direction: str, dslots: np.ndarray, hslots: np.ndarray):
        assert dslots.shape == hslots.shape, (dslots.shape, hslots.shape)
        if dslots.shape[0] == 0:
            return None
        if not self.cuda:
            d, h, kv = torch.from_numpy(dslots), torch.from_numpy(hslots), as_bytes(self.device_pool.kv_buffer)
            if direction == "write":
                self.buffer[h] = kv.index_select(1, d).transpose(0, 1)
            else:
                kv.index_copy_(1, d, self.buffer[h].transpose(0, 1))
            return None
        try:
            return self._transfer_cuda(direction, dslots, hslots)
        except BaseException:
            for stream in self._streams[direction]:  # the caller frees the slots of a failed transfer: its chunks
                stream.synchronize()  # queued already must have ended
            raise

    def _transfer_cuda(self, direction: str, dslots: np.ndarray, hslots: np.ndarray):
        """In chunks through two staging buffers, the PCIe copies on one stream and the device pool's gathers or
        scatters on another, so that chunk k+1 crosses PCIe while chunk k is gathered or scattered."""
        dev = self.device_pool.device
        kv = as_bytes(self.device_pool.kv_buffer)  # [2 * layers, slots, heads, dim]: staging rows are its transpose
        pcie, pool_side = self._streams[direction]
        stages = self._staging[direction]
        rows = stages[0].shape[0]
        pool_side.wait_stream(torch.cuda.current_stream(dev))  # (the PCIe side touches only staging and host memory)
        freed = self._freed[direction]  # per staging buffer: the event after which it may be refilled
        started = torch.cuda.Event(enable_timing=True)
        started.record(pcie)
        with torch.cuda.stream(pool_side):
            d_all = to_device(dslots, torch.int64, dev)
        for k, start in enumerate(range(0, dslots.shape[0], rows)):
            end = min(start + rows, dslots.shape[0])
            stage, n, d = stages[k % 2], end - start, d_all[start:end]
            first, second = (pool_side, pcie) if direction == "write" else (pcie, pool_side)
            with torch.cuda.stream(first):
                if freed[k % 2] is not None:
                    first.wait_event(freed[k % 2])
                if direction == "write":
                    stage[:n].copy_(kv.index_select(1, d).transpose(0, 1))
                else:
                    for off, lo, hi in _runs(hslots[start:end]):
                        stage[off:off + hi - lo].copy_(self.buffer[lo:hi], non_blocking=True)
                filled = torch.cuda.Event()
                filled.record(first)
            with torch.cuda.stream(second):
                second.wait_event(filled)
                if direction == "write":
                    for off, lo, hi in _runs(hslots[start:end]):
                        self.buffer[lo:hi].copy_(stage[off:off + hi - lo], non_blocking=True)
                else:
                    kv.index_copy_(1, d, stage[:n].transpose(0, 1))
                freed[k % 2] = torch.cuda.Event(enable_timing=True)
                freed[k % 2].record(second)
        return Transfer(started, freed[k % 2])  # the last chunk's second stage: after every earlier stage


class Transfer:
    """A transfer in flight on CUDA: query() / synchronize() as an event's, and its device time once done."""
    __slots__ = ("started", "done")

    def __init__(self, started, done):
        self.started, self.done = started, done

    def query(self) -> bool:
        return self.done.query()

    def synchronize(self) -> None:
        self.done.synchronize()

    def seconds(self) -> float:
        """Device time from its first copy's start to its end (it may include waits for the compute stream's
        queued work before its slots can be written)."""
        return self.started.elapsed_time(self.done) / 1e3


class LeaderHostKVPool(HostKVPool):
    """Rank 0's host pool under tensor parallelism. Every rank holds a host pool of its own KV heads with the same
    slots; the tree (rank 0's alone) decides every copy, and each is ordered on the other ranks for the same slots
    (FollowerHostTier): a write with rank 0's next command to them (its forward pass, mostly: `defer`), a load at
    once (`send`), so that theirs overlap with rank 0's. Either way it reaches a rank in the same place among the
    passes as on rank 0, and there waits for the compute stream's queued work as rank 0's does. On CUDA rank 0
    acts on a copy once it sees its event complete (reuses the device slots a write read, admits the requests
    whose prefix a load brought back, frees the slots of an abandoned load); seeing it orders the other ranks to
    queue what comes next after their own copy (HostKVPool.after): a wait on their device, never on a host. On the
    CPU every copy is done when it returns, on every rank in the order rank 0 made them."""

    def __init__(self, device_pool: KVPool, num_tokens: int, defer, send):
        super().__init__(device_pool, num_tokens)
        self._defer, self._send = defer, send
        self._seq = 0

    def _transfer(self, direction: str, dslots: np.ndarray, hslots: np.ndarray):
        transfer = super()._transfer(direction, dslots, hslots)
        if dslots.shape[0] == 0:
            return transfer
        self._seq += 1
        (self._send if direction == "load" else self._defer)(("host_copy", direction, self._seq, dslots, hslots))
        return None if transfer is None else _Seen(transfer, self._seq, self._defer)


class _Seen:
    """One of rank 0's transfers under tensor parallelism: as the Transfer it wraps; once seen complete (query()
    true, or synchronize()) it orders the other ranks to wait for theirs (once)."""
    __slots__ = ("transfer", "seq", "defer")

    def __init__(self, transfer: Transfer, seq: int, defer):
        self.transfer, self.seq, self.defer = transfer, seq, defer

    def query(self) -> bool:
        if not self.transfer.query():
            return False
        self._seen()
        return True

    def synchronize(self) -> None:
        self.transfer.synchronize()
        self._seen()

    def seconds(self) -> float:
        return self.transfer.seconds()

    def _seen(self) -> None:
        if self.defer is not None:
            self.defer(("host_done", self.seq))
            self.defer = None


class FollowerHostTier:
    """A tensor-parallel rank > 0's host tier: rank 0's copies (LeaderHostKVPool's orders) on this rank's host pool
    of its KV heads, at the slots rank 0 chose."""

    def __init__(self, pool: HostKVPool):
        self.pool = pool
        self._pending: dict[int, Transfer] = {}  # rank 0's number of a copy -> ours, not seen complete here

    def copy(self, direction: str, seq: int, dslots: np.ndarray, hslots: np.ndarray) -> None:
        self._pending = {s: t for s, t in self._pending.items() if not t.query()}  # complete: nothing to wait for
        transfer = self.pool.write(dslots, hslots) if direction == "write" else self.pool.load(hslots, dslots)
        if transfer is not None:
            self._pending[seq] = transfer

    def done(self, seq: int) -> None:
        """Rank 0 saw its copy `seq` complete: what this rank queues from now on comes after ours."""
        transfer = self._pending.pop(seq, None)
        if transfer is not None and not transfer.query():
            self.pool.after(transfer)


def _pin(t: torch.Tensor) -> None:
    """Page-lock `t` in place (cudaHostRegister): torch's pinned allocator would round the size up to a power of
    two, up to twice the host memory asked for."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0 or not t.is_pinned():
        raise HostTierError(f"could not pin {nbytes / 2**30:.1f} GiB of host memory for the KV tier "
                            f"(cudaHostRegister: {err}); lower --hicache-ratio or --hicache-size")


def _unpin(t: torch.Tensor, streams: list) -> None:
    """Undo _pin once every copy queued on `streams` (the pool's, the only ones that touch `t`) has ended. Where
    that cannot be done, `t` is kept for the life of the process rather than freed under a copy or still pinned."""
    try:
        for stream in streams:
            stream.synchronize()
        err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        ok = int(getattr(err, "value", err)) == 0
    except Exception:
        ok, err = False, "the device failed"
    if not ok:
        log.warning("host KV tier: %.1f GiB of pinned host memory stays allocated (cudaHostUnregister: %s)",
                    t.numel() * t.element_size() / 2**30, err)
        _KEPT.append(t)


_KEPT: list[torch.Tensor] = []  # host pools whose memory could not be unpinned


def _runs(slots: np.ndarray):
    """(offset in slots, first, end) of each run of consecutive slot ids."""
    if slots.shape[0] == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.shape[0]]))
    return [(int(s), int(slots[s]), int(slots[e - 1]) + 1) for s, e in zip(starts, ends)]


def event_done(event) -> bool:
    return event is None or event.query()
