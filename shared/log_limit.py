"""Warnings a peer can cause once per connection (a failed handshake, a bad frame) are rate-limited: a
client that opens thousands of connections must not be able to flood the log. The first of a kind in each
interval is logged; the rest are counted, and the next one logged says how many were left out."""
from __future__ import annotations

import logging
import time

_MAX_KINDS = 16  # distinct kinds tracked at once; beyond, they share one window (a peer may vary the text)


class LimitedWarning:
    def __init__(self, log: logging.Logger, interval_s: float = 10.0):
        self.log = log
        self.interval_s = interval_s
        self._kinds: dict[str, list] = {}  # kind -> [end of its window, warnings left out in it]

    def warning(self, kind: str, msg: str, *args) -> None:
        """Log `msg % args` unless a warning of `kind` (e.g. the refusal's reason) was logged less than
        `interval_s` ago; then it is only counted."""
        now = time.monotonic()
        if kind not in self._kinds and len(self._kinds) >= _MAX_KINDS:
            self._kinds = {k: v for k, v in self._kinds.items() if v[0] > now}
            if len(self._kinds) >= _MAX_KINDS:
                kind = "(other)"
        window = self._kinds.get(kind)
        if window is not None and now < window[0]:
            window[1] += 1
            return
        left_out = window[1] if window is not None else 0
        self._kinds[kind] = [now + self.interval_s, 0]
        if left_out:
            msg += " (and %d more like it since the last one logged)"
            args = (*args, left_out)
        self.log.warning(msg, *args)
