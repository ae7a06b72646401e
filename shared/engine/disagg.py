"""The engine's two halves of prefill/decode disaggregation, on the engine thread.

PrefillSide: a request taken with transfer {"role": "prefill"} is computed as usual, then parked with its
KV instead of decoding; the transfer glue (services/prefill/kv_push.py) gets a hand-off and pushes the
pages, then ends the transfer, which releases the request (its KV stays in the tree).

DecodeSide: a request taken with transfer {"role": "decode"} waits until its prefill worker has committed
to it (an offer: the transfer's header arrived), then gets slots for what the tree lacks and waits for the
pages (services/decode/kv_receive.py); on arrival they are scattered into the pool and the request joins
the running batch with the first token the prefill side sampled.

Both sides talk to their glue through hooks set by it, called on this thread (the glue moves them to its
event loop); the glue talks back through Engine.call or the thread-safe Engine.kv_* entry points.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from shared.errors import InvalidRequest
from shared.engine.request import PENDING_TOKEN
from shared.protocol import GenerateRequest, KvDone, KvHeader
from shared.transfer import kv_pages

if TYPE_CHECKING:
    from shared.engine.engine import Engine
    from shared.engine.model_runner import StepOutput
    from shared.engine.request import Req

@dataclass
class HandOff:
    """A computed prompt, for the prefill glue. `buf` holds KV of [start, prompt_len) (ready once `event`
    completes) when the decode side's start was known at hand-off, else None (the glue gathers later)."""
    done: KvDone
    start: int | None
    buf: torch.Tensor | None
    event: object | None


def validate_transfer(msg: GenerateRequest, engine: "Engine") -> None:
    t = msg.transfer
    if t is None:
        return
    role, tid = t.get("role"), t.get("id")
    if not isinstance(tid, str) or not tid or len(tid) > 128:
        raise InvalidRequest("transfer.id must be a short string", "transfer")
    if engine.prefill_side.knows(tid) or engine.decode_side.knows(tid):
        raise InvalidRequest(f"duplicate transfer id {tid}", "transfer")
    if role == "prefill":
        if engine.prefill_side.on_transfer_open is None:
            raise InvalidRequest("this worker does not send KV (start it with --role prefill)", "transfer")
        if not isinstance(t.get("host"), str) or not isinstance(t.get("port"), int):
            raise InvalidRequest("transfer needs the decode worker's host and port", "transfer")
    elif role == "decode":
        if engine.decode_side.on_kv_expect is None:
            raise InvalidRequest("this worker does not receive KV (start it with --role decode)", "transfer")
    else:
        raise InvalidRequest("transfer.role must be prefill or decode", "transfer")
    if msg.return_logprob and 0 <= msg.logprob_start_len < len(msg.input_ids):
        raise InvalidRequest("input logprobs are computed where the prompt is: send such requests "
                             "without a transfer", "transfer")


class PrefillSide:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        # Hooks (set by the glue): on_transfer_open(id, {"host","port"}, header) once the scheduler has
        # committed KV to a request; on_kv_ready(id, HandOff | None) once its prompt is computed (None:
        # the request ended first).
        self.on_transfer_open: Callable[[str, dict, KvHeader], None] | None = None
        self.on_kv_ready: Callable[[str, HandOff | None], None] | None = None
        self.starts: dict[str, int] = {}  # the decode side's first missing position, written by the glue
        self._open: set[str] = set()  # transfer opened, prompt not computed yet
        self._handed_off: dict[str, "Req"] = {}  # prompt computed, KV parked until end_transfer

    def knows(self, tid: str) -> bool:
        return tid in self._open or tid in self._handed_off

    @property
    def busy(self) -> bool:
        return bool(self._handed_off)

    def open_new(self) -> None:
        """After a scheduling round: open the transfers of newly admitted requests."""
        sched, pool = self.engine.scheduler, self.engine.runner.kv_pool
        for req in sched.new_transfers:
            self._open.add(req.transfer_id)
            self.on_transfer_open(req.transfer_id, {"host": req.transfer["host"], "port": req.transfer["port"]},
                                  KvHeader(transfer_id=req.transfer_id, prompt_len=len(req.input_ids),
                                           layout=kv_pages.token_layout(pool), dtype=kv_pages.dtype_name(pool.dtype)))
        sched.new_transfers.clear()

    def hand_off(self, req: "Req", out: "StepOutput", i: int) -> None:
        """The prompt's KV is computed and the first token sampled: park the request (it stays in
        scheduler.prefilled, holding its KV) and hand both to the glue. When the handshake already told
        us where the decode side's tree ends, the pages are gathered now, so they can leave without
        another engine round trip."""
        tok = None
        if req.params.max_new_tokens > 0:
            tok = out.next_token_ids[i]
            req.output_ids[req.num_resolved] = tok
            req.num_resolved += 1
        tid = req.transfer_id
        self._open.discard(tid)
        self._handed_off[tid] = req
        done = KvDone(transfer_id=tid, first_token=tok, first_logprob=out.logprobs[i] if tok is not None else None,
                      first_top_logprobs=out.top_logprobs[i] or [],
                      cached_tokens=req.num_cached_tokens or 0)
        start = self.starts.get(tid)
        buf, event = self.gather_kv(tid, start) if start is not None else (None, None)
        self.on_kv_ready(tid, HandOff(done, start, buf, event))

    def gather_kv(self, tid: str, start: int):
        """KV of positions [start, prompt_len) of a handed-off request as one buffer, and a CUDA event to
        wait on before reading it (None on the CPU)."""
        req = self._handed_off.get(tid)
        if req is None or req.finished:
            raise RuntimeError(f"the request of KV transfer {tid} has ended")
        runner = self.engine.runner
        slots = torch.tensor(req.slots[start:len(req.input_ids)], dtype=torch.int64)
        buf = kv_pages.gather(runner.kv_pool, slots, self.engine.config.kv_transfer_staging)
        event = None
        if runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return buf, event

    def end_transfer(self, tid: str, error: str | None) -> None:
        """The decode side has the pages (or the push failed): release the request."""
        req = self._handed_off.pop(tid, None)
        if req is None or req.finished:
            return
        if error:
            self.engine._finish(req, {"type": "abort", "message": error}, error=error)
        else:
            self.engine._finish(req, {"type": "transferred"})

    def on_release(self, req: "Req") -> None:
        tid = req.transfer_id
        self._handed_off.pop(tid, None)
        self.starts.pop(tid, None)
        if tid in self._open:  # ended before its prompt was computed: the glue drops the transfer
            self._open.discard(tid)
            self.on_kv_ready(tid, None)


class DecodeSide:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        # Hooks (set by the glue): on_kv_expect(id, start, prompt_len) once slots are reserved;
        # on_kv_cancel(id) when such a request ends before its pages came.
        self.on_kv_expect: Callable[[str, int, int], None] | None = None
        self.on_kv_cancel: Callable[[str], None] | None = None
        self._waiting: dict[str, "Req"] = {}  # queued, no slots yet
        self._awaiting: dict[str, tuple["Req", float]] = {}  # slots reserved: (request, deadline)
        self._offers: dict[str, float] = {}  # headers that came before their request
        # Received page buffers kept alive until the scatter that reads them has run on the device: the
        # allocator could otherwise hand their memory to the next receive while UCX (not ordered with
        # our stream) writes into it.
        self._in_use: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def knows(self, tid: str) -> bool:
        return tid in self._waiting or tid in self._awaiting

    def on_admit(self, req: "Req") -> None:
        self._waiting[req.transfer_id] = req
        req.kv_offered = self._offers.pop(req.transfer_id, None) is not None

    def offered(self, tid: str) -> None:
        req = self._waiting.get(tid)
        if req is not None:
            req.kv_offered = True
        elif len(self._offers) < 100_000:
            self._offers[tid] = time.monotonic()

    def announce(self) -> None:
        """After a scheduling round: tell the receiver which slots are ready; time out requests whose
        prefill side never committed, or whose pages never came."""
        engine, sched = self.engine, self.engine.scheduler
        timeout = engine.config.kv_transfer_timeout
        now = time.monotonic()
        for req in sched.new_awaiting:
            self._waiting.pop(req.transfer_id, None)
            self._awaiting[req.transfer_id] = (req, now + timeout)
            self.on_kv_expect(req.transfer_id, req.kv_len, len(req.input_ids))
        sched.new_awaiting.clear()
        for tid in [t for t, at in self._offers.items() if at < now - timeout]:
            del self._offers[tid]  # offers for requests that never came (ended at the gateway first)
        late = [e[0] for e in self._awaiting.values() if e[1] < now]
        late += [r for r in self._waiting.values() if not r.kv_offered and r.arrival_time + timeout < now]
        for req in late:
            msg = f"the prompt's KV did not arrive within {timeout:g} s"
            engine._finish(req, {"type": "abort", "message": msg}, error=msg)

    def arrived(self, tid: str, done: KvDone, buf: torch.Tensor) -> None:
        entry = self._awaiting.pop(tid, None)
        if entry is None or entry[0].finished:
            return  # ended (abort, timeout) while its pages were on the way
        engine, req = self.engine, entry[0]
        runner, n = engine.runner, len(req.input_ids)
        kv_pages.scatter(runner.kv_pool, torch.tensor(req.slots[req.kv_len:n], dtype=torch.int64), buf)
        if buf.is_cuda:
            self._in_use = [(e, b) for e, b in self._in_use if not e.query()]
            event = torch.cuda.Event()
            event.record()
            self._in_use.append((event, buf))
        runner.req_pool.write(req.req_pool_idx, 0, torch.tensor(req.slots[:n], dtype=torch.int64))
        engine.scheduler.kv_arrived(req)
        req.transfer = None  # from here on a local request: a retraction recomputes from the tree
        req.num_cached_tokens = done.cached_tokens  # computation saved is the prefill side's hit
        if done.first_token is None:  # max_new_tokens == 0: a cache warm-up (or a top-k probe)
            req.finish_reason = {"type": "length", "length": 0}
            if req.top_logprobs_num > 0:
                req.pending_output_top_logprobs.append(done.first_top_logprobs)
        else:
            req.output_ids.append(PENDING_TOKEN)
            runner.set_last_token(req.req_pool_idx, done.first_token)
            engine._take_token(req, done.first_token, [], done.first_logprob, done.first_top_logprobs)
        engine._emit([req])

    def failed(self, tid: str, reason: str) -> None:
        entry = self._awaiting.get(tid)
        if entry is not None:
            self.engine._finish(entry[0], {"type": "abort", "message": reason}, error=reason)

    def on_release(self, req: "Req") -> None:
        """Ended before its pages came (abort, timeout, failure): the receiver drops the transfer,
        whether slots were reserved yet or not."""
        tid = req.transfer_id
        queued = self._waiting.pop(tid, None) is not None
        if self._awaiting.pop(tid, None) is not None or queued:
            self.on_kv_cancel(tid)
