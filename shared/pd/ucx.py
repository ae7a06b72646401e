"""KV pages between workers over UCX (ucxx, asyncio API): the prefill side pushes, the decode side listens.

One transfer at a time per endpoint (no head-of-line blocking between requests); endpoints are kept and
reused for later transfers to the same decode worker (a UCX connect costs ~13 ms over tcp):

    prefill (when it takes the request)       decode
    KvHeader(id, prompt_len, layout)        ->
                                              waits until its engine has reserved slots for `id`
                                           <- KvAccept(start)   (positions its tree already holds are skipped)
    ... the prefill runs; its engine enqueues the gather of the pages right behind the pass ...
    KV of [start, prompt_len), one message  ->   (as soon as the pass is done)
    KvDone(first token, its logprobs)       ->
                                           <- KvAck             (pages are in the decode side's hands)

The handshake happens while the prompt is computed, so the pages leave the moment they exist. Control
messages are msgpack frames of shared.protocol types, length-checked before any allocation; the KV goes
device to device where UCX can (cuda_ipc / cuda_copy), through host memory otherwise. Every wait has a
timeout: a SIGSTOPped peer otherwise hangs a UCX receive forever.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np
import torch

from shared import protocol
from shared.protocol import KvAccept, KvAck, KvDone, KvHeader, Message, ProtocolError
from shared.log_limit import LimitedWarning
from shared.pd import kv_pages
from shared.pd.kv_pages import as_transport_buffer
from shared.wire import key_matches

log = logging.getLogger(__name__)
_peer_warnings = LimitedWarning(log)  # per-connection warnings: a flood of connections is no log flood
_MAX_CONTROL_BYTES = 1 << 20
_LEN = struct.Struct("!Q")


class TransferError(RuntimeError):
    pass


class TransferCancelled(TransferError):
    """The request ended (client gone, aborted) before its pages could go: not a transport failure."""


_device: torch.device | None = None  # this process's GPU, made current in UCX's progress thread


def use_device(device: torch.device) -> None:
    """The device this process's KV buffers live on; call before the first transfer. UCX's progress thread
    makes it current: ucxx's own start hook makes GPU 0 current, so a worker on another GPU created a CUDA
    context on GPU 0 (memory out of the GPU 0 worker's sizing) and ran UCX's CUDA calls there."""
    global _device
    _device = device


def _progress_thread_start() -> None:
    """Runs first in ucxx's progress thread (in place of ucxx's, which makes GPU 0 current)."""
    if _device is not None and _device.type == "cuda":
        torch.cuda.set_device(_device)


def _ucxx():
    """ucxx, its context created on first use (only PD workers need UCX; call on the event loop).

    Python futures on: every UCX operation we await completes an asyncio future set by ucxx's notifier
    thread. Without them (ucxx's default) an await polls `request.completed` with `asyncio.sleep(0)` in a
    loop, so each pending operation keeps the event loop spinning: the decode worker, which keeps a
    header receive pending on every kept endpoint, burned a whole core in its event-loop thread even
    when idle and took the GIL from its engine thread on every step (decode ITL +30-70% on the H200)."""
    from shared.pd import require_ucx

    require_ucx()  # ucxx is an optional install (.[pd]): say which command adds it
    import ucxx

    from ucxx import core

    if core._ctx is None:
        # A decode worker restarted on its fixed --transfer-port must be able to listen again while the
        # old connections linger in TIME_WAIT (UCX reads this when its context is created).
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        # ucxx's thread mode installs this module function as the progress thread's start callback (ucxx
        # 0.52, the pinned release); tests/pd/test_ucx_device.py fails if a ucxx release stops doing so.
        from ucxx._lib_async import continuous_ucx_progress

        continuous_ucx_progress._create_context = _progress_thread_start
        ucxx.init(progress_mode="thread", enable_python_future=True)
        # The notifier thread is not a daemon: interpreter shutdown joins it before atexit handlers run,
        # so a worker (or any process) that used UCX hung forever on exit after SIGTERM. Stop it in the
        # hook that runs before that join.
        threading._register_atexit(_stop_notifier)
    return ucxx


def _stop_notifier() -> None:
    try:
        import ucxx

        ucxx.stop_notifier_thread()
    except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
        pass


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # an orphaned operation's error (the endpoint was aborted) is expected


async def _io(op) -> None:
    """Await one UCX send/recv without ever cancelling it. Cancelling the await (a timeout, a request
    that ended) would free the buffer while UCX still owns it - a late write into freed memory. The
    operation's own task keeps its buffer alive until UCX completes it, which aborting the endpoint
    does promptly (with an error nobody waits for)."""
    task = asyncio.ensure_future(op)
    task.add_done_callback(_retrieve)
    await asyncio.shield(task)


async def _send_msg(ep, msg: Message) -> None:
    body = protocol.encode(msg)
    await _io(ep.send(np.frombuffer(_LEN.pack(len(body)), dtype=np.uint8)))
    await _io(ep.send(np.frombuffer(body, dtype=np.uint8)))


async def _recv_msg(ep, expect: type[Message]) -> Message:
    head = np.empty(_LEN.size, dtype=np.uint8)
    await _io(ep.recv(head))
    (size,) = _LEN.unpack(head.tobytes())
    if size > _MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {size} bytes exceeds the limit")
    body = np.empty(size, dtype=np.uint8)
    await _io(ep.recv(body))
    msg = protocol.decode(body.data)
    if not isinstance(msg, expect):
        raise ProtocolError(f"expected {expect.TYPE}, got {msg.TYPE}")
    return msg


def _abort(ep) -> None:
    """Drop an endpoint now: cancels its outstanding operations, so no late write lands in a buffer we
    have let go of."""
    try:
        ep.abort()
    except Exception:  # already closed by the peer
        pass


@dataclass
class Expectation:
    """A decode-side reservation: slots are ready for KV of positions [start, prompt_len)."""
    start: int
    prompt_len: int


class KvReceiver:
    """Decode side. `expect`/`cancel` come from the engine (through the event loop); a finished receive
    goes to `on_arrival(transfer_id, done, buffer)`, a failed one to `on_failure(transfer_id, reason)`.
    `expect_timeout` bounds both the wait for the engine's reservation and the wait for the pages (the
    prefill side may queue the request before computing it)."""

    def __init__(self, layout: list[int], dtype: str, alloc: Callable[[int], torch.Tensor],
                 on_arrival: Callable[[str, KvDone, torch.Tensor], None],
                 on_failure: Callable[[str, str], None], on_offer: Callable[[str], None] = lambda tid: None,
                 *, expect_timeout: float = 120.0, io_timeout: float = 60.0, idle_timeout: float = 600.0,
                 key: str = ""):
        self.layout, self.dtype = list(layout), dtype
        self.key = key  # the internal key every header must carry
        self.refused = 0  # headers without it
        self.alloc = alloc
        self.on_arrival, self.on_failure, self.on_offer = on_arrival, on_failure, on_offer
        self.expect_timeout, self.io_timeout, self.idle_timeout = expect_timeout, io_timeout, idle_timeout
        self._expected: dict[str, Expectation] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._listener = None
        self.received_tokens = 0
        self.skipped_tokens = 0  # positions the decode side's own cache already held
        self.received_bytes = 0
        self.failures = 0
        self.cancelled = 0

    async def start(self, port: int = 0) -> int:
        self._listener = _ucxx().create_listener(self._serve, port)
        return self._listener.port

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # engine-driven (call on the event loop)
    def expect(self, transfer_id: str, start: int, prompt_len: int) -> None:
        self._expected[transfer_id] = Expectation(start, prompt_len)
        waiter = self._waiters.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self, transfer_id: str) -> None:
        """The request ended: a push waiting for its reservation gives up now instead of timing out."""
        self._expected.pop(transfer_id, None)
        waiter = self._waiters.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_expected(self, transfer_id: str) -> Expectation:
        if transfer_id not in self._expected:
            fut = self._waiters.setdefault(transfer_id, asyncio.get_running_loop().create_future())
            try:
                async with asyncio.timeout(self.expect_timeout):
                    await fut
            except TimeoutError:
                raise TransferError(f"no request is waiting for KV transfer {transfer_id}") from None
            finally:
                self._waiters.pop(transfer_id, None)
        exp = self._expected.get(transfer_id)
        if exp is None:
            raise TransferCancelled(f"the request of KV transfer {transfer_id} has ended")
        return exp

    async def _serve(self, ep) -> None:
        """Transfers one after another on this endpoint, until the prefill side closes it (or one fails)."""
        while await self._serve_one(ep):
            pass

    async def _serve_one(self, ep) -> bool:
        """One transfer; True when the endpoint is quiescent and may carry the next one."""
        try:
            async with asyncio.timeout(self.idle_timeout):
                header = await _recv_msg(ep, KvHeader)
        except Exception:  # the prefill side closed or dropped the endpoint, or it sat idle too long
            _abort(ep)
            return False
        if not key_matches(self.key, header.key):
            self.refused += 1  # not a worker of this stack: say nothing, touch nothing
            _peer_warnings.warning("wrong key", "KV header with a wrong internal key refused")
            _abort(ep)
            return False
        transfer_id = header.transfer_id
        try:
            if header.layout != self.layout or header.dtype != self.dtype:
                raise TransferError(f"KV layout {header.layout} {header.dtype} does not match this worker's "
                                    f"{self.layout} {self.dtype} (a different model, or another --kv-cache-dtype?)")
            self.on_offer(transfer_id)  # the engine may now reserve slots for it
            exp = await self._wait_expected(transfer_id)
            if header.prompt_len != exp.prompt_len:
                raise TransferError(f"KV transfer {transfer_id}: {header.prompt_len} positions offered, "
                                    f"the request has {exp.prompt_len}")
            async with asyncio.timeout(self.io_timeout):
                await _send_msg(ep, KvAccept(transfer_id=transfer_id, start=exp.start))
            buf = self.alloc(exp.prompt_len - exp.start)
            queued = kv_pages.queued_work(buf)
            async with asyncio.timeout(self.expect_timeout):
                if queued is not None:
                    await asyncio.to_thread(queued.synchronize)
                if buf.numel():
                    await _io(ep.recv(as_transport_buffer(buf)))
            async with asyncio.timeout(self.io_timeout):
                done = await _recv_msg(ep, KvDone)
                if done.transfer_id != transfer_id:
                    raise ProtocolError("KV done names another transfer")
            self.received_bytes += buf.numel() * buf.element_size()
            if self._expected.pop(transfer_id, None) is not None:
                self.received_tokens += exp.prompt_len - exp.start
                self.skipped_tokens += exp.start
                self.on_arrival(transfer_id, done, buf)  # to the engine first, the ack after: off the path
            # (else the request ended while its pages were on the way)
            async with asyncio.timeout(self.io_timeout):
                await _send_msg(ep, KvAck(transfer_id=transfer_id))
            return True
        except Exception as e:  # ProtocolError, TransferError, UCX errors, timeouts
            reason = str(e) or type(e).__name__
            if isinstance(e, TransferCancelled) or transfer_id not in self._expected:
                self.cancelled += 1  # the request had ended: its prefill side dropped the transfer
            else:
                self.failures += 1
                _peer_warnings.warning(f"failed: {type(e).__name__}", "KV receive %s failed: %s", transfer_id, reason)
            if isinstance(e, TransferError):
                try:
                    async with asyncio.timeout(5):
                        await _send_msg(ep, KvAccept(transfer_id=transfer_id, error=reason))
                except Exception:
                    pass
            _abort(ep)
            if self._expected.pop(transfer_id, None) is not None:
                self.on_failure(transfer_id, f"KV transfer failed: {reason}")
            return False


@dataclass
class OpenTransfer:
    """A prefill-side transfer past its handshake: the decode side wants [start, prompt_len)."""
    ep: object
    header: KvHeader
    start: int
    peer: tuple[str, int]
    wire_start: float = 0.0
    wire_seconds: float = 0.0  # the pages' send, until UCX reports it done
    sent_bytes: int = 0


class KvSender:
    """Prefill side: `open` when the request is taken (handshake overlaps the prefill), `finish` with the
    pages and the first token once the prompt is computed, `abort` otherwise."""

    def __init__(self, *, connect_timeout: float = 10.0, io_timeout: float = 60.0,
                 accept_timeout: float = 130.0, max_idle_per_peer: int = 16, key: str = ""):
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.key = key
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[tuple[str, int], list] = {}  # quiescent endpoints, by decode worker
        self.connects = 0
        self.reuses = 0
        self.accept_timeout = accept_timeout  # the decode side waits up to its expect_timeout for slots
        self.sent_tokens = 0
        self.sent_bytes = 0
        self.send_seconds = 0.0  # the wire part alone: the pages' sends
        self.transfers = 0

    async def _connect(self, host: str, port: int):
        try:
            async with asyncio.timeout(self.connect_timeout):
                ep = await _ucxx().create_endpoint(host, port)
        except Exception as e:
            raise TransferError(f"cannot reach the decode worker's KV receiver at {host}:{port}: {e}") from None
        self.connects += 1
        return ep

    async def _send_header(self, ep, header: KvHeader) -> None:
        try:
            async with asyncio.timeout(self.io_timeout):
                await _send_msg(ep, msgspec.structs.replace(header, key=self.key))
        except BaseException:
            _abort(ep)
            raise

    async def _handshake(self, ep, header: KvHeader) -> KvAccept:
        try:
            await self._send_header(ep, header)
            async with asyncio.timeout(self.accept_timeout):
                accept = await _recv_msg(ep, KvAccept)
        except BaseException:
            _abort(ep)
            raise
        return accept

    async def open(self, host: str, port: int, header: KvHeader) -> OpenTransfer:
        """Header out, accept back: on a kept endpoint when one is idle, else on a new one. A kept
        endpoint that fails before the decode side answered (it restarted, the link broke) is dropped
        and the handshake retried once on a fresh connection."""
        idle = self._idle.get((host, port), [])
        accept, ep = None, None
        while idle and accept is None:
            ep = idle.pop()
            try:
                accept = await self._handshake(ep, header)
                self.reuses += 1
            except (TimeoutError, asyncio.CancelledError):
                raise  # the decode side is slow, not gone: a second header would not help
            except Exception:
                accept = None
        try:
            if accept is None:
                ep = await self._connect(host, port)
                accept = await self._handshake(ep, header)
            if accept.error:
                raise TransferError(f"the decode worker refused the KV: {accept.error}")
            if accept.transfer_id != header.transfer_id or not 0 <= accept.start < header.prompt_len:
                raise ProtocolError(f"KV accept (start {accept.start}) does not fit the transfer")
        except BaseException as e:
            if ep is not None:
                _abort(ep)
            if isinstance(e, (TransferError, asyncio.CancelledError)):
                raise
            raise TransferError(f"KV handshake with {host}:{port} failed: {str(e) or type(e).__name__}") from None
        return OpenTransfer(ep, header, accept.start, (host, port))

    async def send_pages(self, t: OpenTransfer, buf: torch.Tensor) -> None:
        """The KV of [t.start, prompt_len), one message (it may go before the first token is known)."""
        t.wire_start = time.perf_counter()
        try:
            async with asyncio.timeout(self.io_timeout):
                await _io(t.ep.send(as_transport_buffer(buf)))
        except BaseException as e:
            _abort(t.ep)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TransferError(f"KV transfer failed: {str(e) or type(e).__name__}") from None
        t.sent_bytes = buf.numel() * buf.element_size()
        t.wire_seconds = time.perf_counter() - t.wire_start
        self.send_seconds += t.wire_seconds

    async def complete(self, t: OpenTransfer, done: KvDone) -> None:
        """The first token after the pages, then the decode side's ack; the endpoint is kept for reuse."""
        try:
            async with asyncio.timeout(self.io_timeout):
                await _send_msg(t.ep, done)
                await _recv_msg(t.ep, KvAck)
        except BaseException as e:
            _abort(t.ep)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TransferError(f"KV transfer failed: {str(e) or type(e).__name__}") from None
        self.sent_tokens += t.header.prompt_len - t.start
        self.sent_bytes += t.sent_bytes
        self.transfers += 1
        idle = self._idle.setdefault(t.peer, [])
        if len(idle) < self.max_idle_per_peer:
            idle.append(t.ep)  # quiescent: every message of this transfer is acknowledged
            return
        try:
            await t.ep.close()
        except Exception:
            _abort(t.ep)

    async def finish(self, t: OpenTransfer, buf: torch.Tensor, done: KvDone) -> None:
        await self.send_pages(t, buf)
        await self.complete(t, done)

    @staticmethod
    def abort(t: OpenTransfer) -> None:
        _abort(t.ep)
