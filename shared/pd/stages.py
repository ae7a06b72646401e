"""The PD stage queues (the stages are described in shared/pd/sides.py's docstring): plain
containers of requests by stage, so the scheduler can ask about them without importing the PD sides;
and each side's TransferBudget, the bytes of KV buffers its transfers may hold at once."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.request import Req


class TransferBudget:
    """Bytes of KV buffers outside the pool that one side's transfers hold at once: the prefill side's
    gathered pages (charged from a request's first admission, for its whole prompt, then from the gather
    for the positions the decode side asked for, until its push ends),
    the decode side's receive buffers (charged from the reservation of its slots, for the positions it
    lacks, until the pages are scattered). Without a bound a slow decode side let a prefill worker gather
    prompt after prompt (1 GiB per 8k tokens of an 8B model) until its GPU ran out of memory.

    The scheduler admits a transfer only when it `fits`; one that does not waits in the queue, in order
    (the budget frees as transfers end). Nothing charged: any transfer fits, so a prompt larger than the
    whole budget goes alone and nothing waits forever. max_bytes 0: no bound (the charges are still
    counted). Used on the engine thread only."""

    def __init__(self, max_bytes: int = 0, token_bytes: int = 0):
        self.max_bytes, self.token_bytes = max_bytes, token_bytes
        self._held: dict[str, int] = {}  # bytes by transfer id
        self.in_flight = 0
        self.peak = 0
        self.waits = 0  # admission rounds in which a transfer waited for room

    def fits(self, tid: str, tokens: int) -> bool:
        """May transfer `tid` of `tokens` positions be admitted now (already charged: yes)?"""
        ok = (self.max_bytes <= 0 or not self._held or tid in self._held
              or self.in_flight + tokens * self.token_bytes <= self.max_bytes)
        self.waits += not ok
        return ok

    def take(self, tid: str, tokens: int) -> None:
        if tid in self._held:
            return
        n = self._held[tid] = tokens * self.token_bytes
        self.in_flight += n
        self.peak = max(self.peak, self.in_flight)

    def shrink(self, tid: str, tokens: int) -> None:
        """Transfer `tid`'s buffer turned out to hold only `tokens` positions (never grows a charge)."""
        held = self._held.get(tid)
        if held is not None and tokens * self.token_bytes < held:
            self._held[tid] = tokens * self.token_bytes
            self.in_flight -= held - self._held[tid]

    def give(self, tid: str) -> None:
        """Transfer `tid`'s buffer is gone (idempotent)."""
        self.in_flight -= self._held.pop(tid, 0)

    def stats(self) -> dict:
        return {"max_bytes": self.max_bytes, "token_bytes": self.token_bytes, "in_flight_bytes": self.in_flight,
                "peak_bytes": self.peak, "transfers": len(self._held), "waits": self.waits}


class PrefillStages:
    """The prefill side's requests by stage (module docstring). Owned by PrefillSide; the scheduler
    calls admit, park, holds_kv, unpark and remove."""

    def __init__(self, budget: TransferBudget | None = None):
        self.budget = budget if budget is not None else TransferBudget()  # gathered pages (given back by the side)
        self.admitted: list["Req"] = []  # admitted in the last round: transfer to open
        self.computing: dict[str, "Req"] = {}  # transfer open, first token not sampled yet
        self.transferring: dict[str, "Req"] = {}  # first token handed off, pages being pushed
        self.prefilled: list["Req"] = []  # last chunk scheduled: parked with its KV until released

    def knows(self, tid: str) -> bool:
        return tid in self.computing or tid in self.transferring

    # scheduler side
    def admit(self, req: "Req") -> None:
        """First admission of the request (its transfer opens after the round): its prompt's pages are
        charged to the budget (the most its gather can be)."""
        self.admitted.append(req)
        self.budget.take(req.transfer_id, len(req.input_ids))

    def park(self, req: "Req") -> None:
        """The prompt's last chunk is scheduled: the request is parked here with its KV."""
        self.prefilled.append(req)

    def holds_kv(self) -> bool:
        return bool(self.prefilled)

    def unpark(self, req: "Req") -> None:
        """Back to the scheduler's queue after a failed step (its KV is released by the scheduler)."""
        for lst in (self.prefilled, self.admitted):
            if req in lst:
                lst.remove(req)

    def remove(self, req: "Req") -> tuple[str, ...]:
        """Out of every stage (idempotent); the stages it left."""
        left = []
        for name in ("admitted", "prefilled"):
            lst = getattr(self, name)
            if req in lst:
                lst.remove(req)
                left.append(name)
        for name in ("computing", "transferring"):
            if getattr(self, name).pop(req.transfer_id, None) is not None:
                left.append(name)
        return tuple(left)

    # side
    def open(self, req: "Req") -> None:
        self.computing[req.transfer_id] = req

    def hand_off(self, req: "Req") -> None:
        self.computing.pop(req.transfer_id, None)
        self.transferring[req.transfer_id] = req


class DecodeStages:
    """The decode side's requests by stage (module docstring). Owned by DecodeSide; the scheduler calls
    admissible, reserve, holding/num_holding and remove."""

    def __init__(self, budget: TransferBudget | None = None):
        self.budget = budget if budget is not None else TransferBudget()  # receive buffers (given back by the side)
        self.queued: dict[str, "Req"] = {}  # taken, no slots yet
        self.reserved: dict[str, "Req"] = {}  # slots reserved in the last round, receiver not told yet
        self.awaiting: dict[str, tuple["Req", float]] = {}  # receiver told: (request, deadline)

    def knows(self, tid: str) -> bool:
        return tid in self.queued or tid in self.reserved or tid in self.awaiting

    # scheduler side
    @staticmethod
    def admissible(req: "Req") -> bool:
        """May the scheduler admit this waiting request? A decode-side one only once offered."""
        return req.transfer_role != "decode" or req.kv_offered

    def reserve(self, req: "Req") -> None:
        """The scheduler has reserved the request's slots (queued -> reserved); the positions it lacks
        (its receive buffer) are charged to the budget."""
        self.budget.take(req.transfer_id, len(req.input_ids) - req.kv_len)
        self.queued.pop(req.transfer_id, None)
        self.reserved[req.transfer_id] = req

    def holding(self) -> list["Req"]:
        """Requests holding slots whose pages are not in yet, in reservation order."""
        return [e[0] for e in self.awaiting.values()] + list(self.reserved.values())

    def num_holding(self) -> int:
        return len(self.awaiting) + len(self.reserved)

    def remove(self, req: "Req") -> tuple[str, ...]:
        """Out of every stage (idempotent); the stages it left."""
        tid = req.transfer_id
        return tuple(name for name in ("queued", "reserved", "awaiting")
                     if getattr(self, name).pop(tid, None) is not None)

    # side
    def expect(self, req: "Req", deadline: float) -> None:
        """The receiver is told (reserved -> awaiting)."""
        self.reserved.pop(req.transfer_id, None)
        self.awaiting[req.transfer_id] = (req, deadline)

    def arrived(self, tid: str) -> "Req | None":
        """Pages are in (awaiting -> ready): the request, or None if it is no longer awaiting."""
        entry = self.awaiting.pop(tid, None)
        return entry[0] if entry is not None else None
