"""Redis is metadata, never a dependency: a call that fails is logged once per outage (not per beat),
retried with backoff, and the caller keeps serving on what it last knew."""
from __future__ import annotations

import logging
import time


class Outage:
    """Tracks one connection to the metadata store: `failed` and `ok` log only the transitions."""

    def __init__(self, what: str, log: logging.Logger, base_s: float = 0.25, max_s: float = 2.0):
        self.what = what
        self.log = log
        self.base_s, self.max_s = base_s, max_s
        self.since: float | None = None  # monotonic start of the current outage
        self.up_since: float = time.monotonic()
        self._failures = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: BaseException) -> float:
        """Record a failed call; returns how long to wait before the next try."""
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s: metadata store unreachable (%s: %s); serving on with what is known, "
                             "retrying", self.what, type(error).__name__, error)
        self._failures += 1
        return min(self.base_s * 2 ** (self._failures - 1), self.max_s)

    def ok(self) -> bool:
        """Record a successful call; True when it ends an outage."""
        self._failures = 0
        if self.since is None:
            return False
        self.log.warning("%s: metadata store reachable again after %.1f s", self.what,
                         time.monotonic() - self.since)
        self.since = None
        self.up_since = time.monotonic()
        return True
