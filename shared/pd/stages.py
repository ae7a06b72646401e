"""The PD stage queues (the stages are described in shared/pd/sides.py's docstring): plain
containers of requests by stage, so the scheduler can ask about them without importing the PD sides."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.request import Req


class PrefillStages:
    """The prefill side's requests by stage (module docstring). Owned by PrefillSide; the scheduler
    calls admit, park, holds_kv, unpark and remove."""

    def __init__(self):
        self.admitted: list["Req"] = []  # admitted in the last round: transfer to open
        self.computing: dict[str, "Req"] = {}  # transfer open, first token not sampled yet
        self.transferring: dict[str, "Req"] = {}  # first token handed off, pages being pushed
        self.prefilled: list["Req"] = []  # last chunk scheduled: parked with its KV until released

    def knows(self, tid: str) -> bool:
        return tid in self.computing or tid in self.transferring

    # scheduler side
    def admit(self, req: "Req") -> None:
        """First admission of the request (its transfer opens after the round)."""
        self.admitted.append(req)

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

    def __init__(self):
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
        """The scheduler has reserved the request's slots (queued -> reserved)."""
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
