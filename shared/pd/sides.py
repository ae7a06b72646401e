"""The engine's two halves of prefill/decode disaggregation, on the engine thread.

Each side keeps its requests in stage queues (shared/pd/stages.py) that it owns; the scheduler
asks them through a few methods (admissible, reserve, park, holds_kv, remove, ...) and keeps no PD list
of its own. The stages, in order:

Prefill side (a request taken with transfer {"role": "prefill"}), by transfer:
  admitted      admitted in the last scheduling round; the side opens its transfer after the round
                (on_transfer_open: the handshake runs while the prompt is computed)
  computing     transfer open, prompt being computed (in the scheduler's batch or chunked request)
  transferring  first token sampled and handed to the glue (shared/pd/kv_push.py), which pushes
                the pages and then ends the transfer (end_transfer)
  done          released through Engine.end_request; its KV stays in the tree
and, alongside, by KV: `prefilled` from the scheduling round that takes its last chunk until it is
released: the request never decodes here, it is parked holding its KV (the pages are gathered right
after that pass is launched, on_kv_gathered).

Decode side (a request taken with transfer {"role": "decode"}):
  queued        taken, no slots yet; admissible to the scheduler only once offered (its prefill worker
                has committed to it: the transfer's header arrived), so slots are never held for
                prompts the prefill side cannot start (the two pools would wait on each other)
  reserved      the scheduler reserved slots for what the tree lacks, in the last round; the side tells
                the receiver after the round (on_kv_expect)
  awaiting      the receiver (shared/pd/kv_receive.py) waits for the pages, until a deadline
  ready         pages scattered into the pool: the request leaves the stages and joins the scheduler's
                running batch with the first token the prefill side sampled (Engine.start_decoding)
A request that ends at any stage (abort, timeout, failure) leaves its stage; the scheduler releases
its slots and the receiver drops the transfer (on_kv_cancel).

Each side's stages carry a TransferBudget (stages.py): the bytes of KV buffers outside the pool its
transfers hold. The scheduler charges a transfer when it admits it (prefill: the whole prompt, at first
admission, cut to the positions the decode side asked for once they are gathered; decode: the positions it lacks,
at reservation) and admits no transfer beyond the budget; the
sides give the bytes back when the buffer is gone (prefill: the push ended, end_transfer, or the request
ended before it began; decode: the pages were scattered, or the request ended before they came).

Both sides talk to their glue through hooks set by it, called on this thread (the glue moves them to its
event loop); the glue talks back through Engine.call or the thread-safe Engine.kv_* entry points. They
end and start requests through the engine's public end_request / start_decoding, and record each
request's hand-over parts (PartTimes) for the workers' stats.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from shared.errors import InvalidRequest
from shared.protocol import FinishReason, FinishTransferred, GenerateRequest, KvDone, KvHeader
from shared.pd.stages import DecodeStages, PrefillStages, TransferBudget
from shared.pd import kv_pages

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.engine.model_runner import ModelRunner, StepOutput
    from shared.engine.request import Req
    from shared.engine.schedule_policy import SchedulePolicy


class EngineView(Protocol):
    """What the two sides use of their engine (shared/engine/engine_loop.py's Engine): its config, runner and
    scheduling policy, and its public way to end a request or start one decoding."""
    config: EngineConfig
    runner: ModelRunner
    policy: SchedulePolicy

    def end_request(self, req: Req, error: str | None = None, reason: FinishReason | None = None) -> None: ...

    def start_decoding(self, req: Req, first_token: int | None, logprob, top_logprobs) -> None: ...

@dataclass
class Pages:
    """KV of positions [start, prompt_len) of a prompt, gathered right after the launch of the pass that
    computes its last chunk (same stream: the copy runs when the pass has written the KV), readable
    once `event` completes (None on the CPU). `start` is the decode side's start when the handshake had
    answered by then, else 0 (the glue sends the suffix the decode side asked for)."""
    start: int
    buf: torch.Tensor
    event: object | None


@dataclass
class HandOff:
    """A computed prompt: the first token (and what else the decode side needs), with the times of its
    life on this worker (time.monotonic) for the hand-over breakdown."""
    done: KvDone
    arrival: float
    admitted: float
    computed: float


class PartTimes:
    """Recent requests' hand-over parts (seconds in, milliseconds out): p50/p99 per part, for stats."""

    def __init__(self, keep: int = 4096):
        self._rows: deque[dict[str, float]] = deque(maxlen=keep)

    def add(self, **parts: float) -> None:
        self._rows.append(parts)

    def summary(self) -> dict:
        rows = tuple(self._rows)  # one C-level copy: safe against appends from the engine thread
        out: dict = {"requests": len(rows)}
        for name in (rows[0] if rows else {}):
            xs = sorted(r[name] for r in rows if name in r)
            out[name] = {"p50": round(xs[len(xs) // 2] * 1e3, 3),
                         "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3)}
        return out



def transfer_budget(config: EngineConfig, runner: ModelRunner) -> TransferBudget:
    """A side's budget of KV buffer bytes (--kv-transfer-max-bytes, or derived: sizing.transfer_budget_bytes)."""
    from shared.engine import sizing

    token_bytes = runner.kv_transfer_token_bytes()
    return TransferBudget(sizing.transfer_budget_bytes(config, token_bytes), token_bytes)


def validate_transfer(msg: GenerateRequest, prefill_side: PrefillSide, decode_side: DecodeSide) -> None:
    t = msg.transfer
    if t is None:
        return
    role, tid = t.role, t.id  # types checked on the wire; values here
    if not tid or len(tid) > 128:
        raise InvalidRequest("transfer.id must be a short string", "transfer")
    if prefill_side.knows(tid) or decode_side.knows(tid):
        raise InvalidRequest(f"duplicate transfer id {tid}", "transfer")
    if role == "prefill":
        if prefill_side.on_transfer_open is None:
            raise InvalidRequest("this worker does not send KV (start it with --role prefill)", "transfer")
        if not t.host or t.port is None:
            raise InvalidRequest("transfer needs the decode worker's host and port", "transfer")
    elif role == "decode":
        if decode_side.on_kv_expect is None:
            raise InvalidRequest("this worker does not receive KV (start it with --role decode)", "transfer")
    else:
        raise InvalidRequest("transfer.role must be prefill or decode", "transfer")
    if msg.wants_input_logprobs:
        raise InvalidRequest("input logprobs are computed where the prompt is: send such requests "
                             "without a transfer", "transfer")


class PrefillSide:
    def __init__(self, engine: EngineView, budget: TransferBudget | None = None):
        self.engine = engine
        # Hooks (set by the glue): on_transfer_open(id, {"host","port"}, header) once the scheduler has
        # committed KV to a request; on_kv_gathered(id, Pages) when the pass computing its last chunk is
        # launched; on_kv_ready(id, HandOff | None) once its first token is sampled (None: the request
        # ended first).
        self.on_transfer_open: Callable[[str, dict, KvHeader], None] | None = None
        self.on_kv_gathered: Callable[[str, Pages], None] | None = None
        self.on_kv_ready: Callable[[str, HandOff | None], None] | None = None
        self.starts: dict[str, int] = {}  # the decode side's first missing position, written by the glue
        self.stages = PrefillStages(budget)  # (budget: of the gathered pages, transfer_budget; None: no bound)

    def knows(self, tid: str) -> bool:
        return self.stages.knows(tid)

    @property
    def busy(self) -> bool:
        return bool(self.stages.transferring)

    def open_new(self) -> None:
        """After a scheduling round: open the transfers of newly admitted requests (admitted ->
        computing; the handshake runs while their prefill does)."""
        runner = self.engine.runner
        for req in self.stages.admitted:
            self.stages.open(req)
            self.on_transfer_open(req.transfer_id, {"host": req.transfer.host, "port": req.transfer.port},
                                  KvHeader(transfer_id=req.transfer_id, prompt_len=len(req.input_ids),
                                           layout=runner.kv_layout(), dtype=kv_pages.dtype_name(runner.kv_dtype)))
        self.stages.admitted.clear()

    def on_launch(self, reqs: list["Req"], sample: list[bool]) -> None:
        """A pass was just enqueued: for each prompt it completes, enqueue the gather of its pages
        behind it, so they can leave as soon as the pass is done - not a step later, when the host
        learns the first token (with overlap that is after the next pass is launched, and a gather
        then would wait for that pass too)."""
        for req, last_chunk in zip(reqs, sample):
            if last_chunk and req.transfer_role == "prefill" and not req.finished:
                start = self.starts.get(req.transfer_id, 0)
                # Charged for the whole prompt at admission (the decode side's start was not known yet): from
                # here on only what is gathered.
                self.stages.budget.shrink(req.transfer_id, len(req.input_ids) - start)
                buf, event = self._gather(req, start)
                self.on_kv_gathered(req.transfer_id, Pages(start, buf, event))

    def hand_off(self, req: "Req", out: "StepOutput", i: int) -> None:
        """The first token is sampled (computing -> transferring; the request stays prefilled, holding
        its KV): hand the token to the glue, which sends it after the pages."""
        tok = None
        if req.params.max_new_tokens > 0:
            tok = out.next_token_ids[i]
            req.output_ids[req.num_resolved] = tok
            req.num_resolved += 1
        tid = req.transfer_id
        self.stages.hand_off(req)
        done = KvDone(transfer_id=tid, first_token=tok, first_logprob=out.logprobs[i] if tok is not None else None,
                      first_top_logprobs=out.top_logprobs[i] or [],
                      cached_tokens=req.num_cached_tokens or 0)
        self.on_kv_ready(tid, HandOff(done, req.arrival_time, req.first_scheduled_time or req.arrival_time,
                                      time.monotonic()))

    def _gather(self, req: "Req", start: int):
        runner = self.engine.runner
        slots = torch.tensor(req.slots[start:len(req.input_ids)], dtype=torch.int64)
        buf = runner.gather_kv(slots, self.engine.config.kv_transfer_staging)
        event = None
        if runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return buf, event

    def end_transfer(self, tid: str, error: str | None) -> None:
        """The decode side has the pages (or the push failed): release the request (transferring ->
        done): its gathered pages are gone, so is their share of the budget."""
        self.stages.budget.give(tid)
        req = self.stages.transferring.pop(tid, None)
        if req is None or req.finished:
            return
        self.engine.end_request(req, error, None if error else FinishTransferred())

    def on_release(self, req: "Req") -> None:
        """The request ends (Engine.end_request, before the scheduler releases its KV): out of its
        stages."""
        tid = req.transfer_id
        self.starts.pop(tid, None)
        left = self.stages.remove(req)
        if "transferring" not in left:  # (else its pages are still being pushed: end_transfer gives them back)
            self.stages.budget.give(tid)
        if "computing" in left:  # ended before its prompt was computed:
            self.on_kv_ready(tid, None)  # the glue drops the transfer


class DecodeSide:
    def __init__(self, engine: EngineView, budget: TransferBudget | None = None):
        self.engine = engine
        # Hooks (set by the glue): on_kv_expect(id, start, prompt_len) once slots are reserved;
        # on_kv_cancel(id) when such a request ends before its pages came.
        self.on_kv_expect: Callable[[str, int, int], None] | None = None
        self.on_kv_cancel: Callable[[str], None] | None = None
        self.stages = DecodeStages(budget)  # (budget: of the receive buffers, transfer_budget; None: no bound)
        self._offers: dict[str, float] = {}  # headers that came before their request
        # Received page buffers kept alive until the scatter that reads them has run on the device: the
        # allocator could otherwise hand their memory to the next receive while UCX (not ordered with
        # our stream) writes into it. Their transfer ids: the budget is given back when they are let go.
        self._in_use: list[tuple[torch.cuda.Event, torch.Tensor, str]] = []
        # Hand-over breakdown: per transfer the times it was offered and got its slots; per request
        # whose pages were scattered, the times up to its first decode step's token.
        self.times = PartTimes()
        self._stamps: dict[str, list[float]] = {}
        self._first_step: dict[str, tuple[float, ...]] = {}

    def knows(self, tid: str) -> bool:
        return self.stages.knows(tid)

    def on_admit(self, req: "Req") -> None:
        """The engine took the request: queued."""
        self.stages.queued[req.transfer_id] = req
        offered_at = self._offers.pop(req.transfer_id, None)
        req.kv_offered = offered_at is not None
        self._stamps[req.transfer_id] = [req.arrival_time, offered_at or 0.0, 0.0]

    def offered(self, tid: str) -> None:
        req = self.stages.queued.get(tid)
        if req is None:
            req = self.stages.reserved.get(tid)
        if req is not None:
            req.kv_offered = True
            self._stamps[tid][1] = time.monotonic()
        elif len(self._offers) < 100_000:
            self._offers[tid] = time.monotonic()

    def announce(self) -> None:
        """After a scheduling round: tell the receiver which slots are ready (reserved -> awaiting);
        time out requests whose prefill side never committed (queued), or whose pages never came
        (awaiting)."""
        engine, stages = self.engine, self.stages
        timeout = engine.config.kv_transfer_timeout
        now = time.monotonic()
        self._drop_scattered()
        for req in list(stages.reserved.values()):
            stages.expect(req, now + timeout)
            self._stamps[req.transfer_id][2] = now
            self.on_kv_expect(req.transfer_id, req.kv_len, len(req.input_ids))
        for tid in [t for t, at in self._offers.items() if at < now - timeout]:
            del self._offers[tid]  # offers for requests that never came (ended at the gateway first)
        late = [e[0] for e in stages.awaiting.values() if e[1] < now]
        late += [r for r in stages.queued.values() if not r.kv_offered and r.arrival_time + timeout < now]
        for req in late:
            msg = f"the prompt's KV did not arrive within {timeout:g} s"
            engine.end_request(req, msg)

    def arrived(self, tid: str, done: KvDone, buf: torch.Tensor, received_at: float = 0.0) -> None:
        """Pages and first token are here (`received_at`: when the receiver had them): scatter, emit the
        first token, and the request decodes from this very step on (awaiting -> ready)."""
        picked_at = time.monotonic()
        req = self.stages.arrived(tid)
        stamps = self._stamps.pop(tid, None)
        if req is None or req.finished:
            return  # ended (abort, timeout) while its pages were on the way
        engine = self.engine
        runner, n = engine.runner, len(req.input_ids)
        try:
            runner.scatter_kv(torch.tensor(req.slots[req.kv_len:n], dtype=torch.int64), buf)
        except Exception as e:
            # (Out of device memory for a host-staged buffer's copy, say.) This request ends; raised from the
            # inbox, outside any step, it ended every request of the worker.
            log.warning("writing the received KV of %s failed: %r", req.rid, e)
            self.stages.budget.give(tid)
            engine.end_request(req, f"the received KV could not be written: {type(e).__name__}")
            return
        if buf.is_cuda:
            self._drop_scattered()
            event = torch.cuda.Event()
            event.record()
            self._in_use.append((event, buf, tid))
        else:
            self.stages.budget.give(tid)  # scattered: the buffer is let go
        # Host slots (the table stages them without blocking): a device tensor would be read back (waiting for the
        # pass in flight) to reach the other tensor-parallel ranks.
        runner.req_pool.write(req.req_pool_idx, 0, torch.tensor(req.slots[:n], dtype=torch.int32))
        engine.policy.kv_arrived(req)
        req.transfer = None  # from here on a local request: a retraction recomputes from the tree
        req.num_cached_tokens = done.cached_tokens  # computation saved is the prefill side's hit
        engine.start_decoding(req, done.first_token, done.first_logprob, done.first_top_logprobs)
        if stamps is not None and not req.finished:
            self._first_step[req.rid] = (*stamps, received_at or picked_at, picked_at, time.monotonic())

    def _drop_scattered(self) -> None:
        """Let go of received buffers whose scatter has run: here at every round too, not only at the next
        arrival (the last buffers of a burst, GBs for long prompts, were held until the next request came)."""
        if self._in_use:
            kept = []
            for entry in self._in_use:
                if entry[0].query():
                    self.stages.budget.give(entry[2])
                else:
                    kept.append(entry)
            self._in_use = kept

    @property
    def timing(self) -> bool:
        """Requests wait for their first decode step's token (the engine then calls first_step_done)."""
        return bool(self._first_step)

    def first_step_done(self, req: "Req") -> None:
        """Engine: a token of `req` reached the host. The first after its pages: record the breakdown."""
        st = self._first_step.pop(req.rid, None)
        if st is None:
            return
        arrival, offered, reserved, received, picked, scattered = st
        self.times.add(reserve=max(0.0, reserved - max(arrival, offered)), inbox=max(0.0, picked - received),
                       scatter=scattered - picked, first_step=time.monotonic() - scattered)

    def failed(self, tid: str, reason: str) -> None:
        entry = self.stages.awaiting.get(tid)
        if entry is not None:
            self.engine.end_request(entry[0], reason)

    def on_release(self, req: "Req") -> None:
        """The request ends (Engine.end_request, before the scheduler releases its slots). Before its
        pages came (abort, timeout, failure; queued, reserved or awaiting): the receiver drops the
        transfer."""
        tid = req.transfer_id
        self._stamps.pop(tid, None)
        self._first_step.pop(req.rid, None)
        if self.stages.remove(req):
            self.stages.budget.give(tid)
            self.on_kv_cancel(tid)
