"""Unique hex ids without a uuid4 per call.

A request id only has to be unique across every process that talks to the
same workers. 64 random bits drawn once per process, followed by a 64-bit
counter, give 32 hex digits (the width of a uuid4 hex) at the cost of one
``next()`` and one format per id. ``os.register_at_fork`` redraws the prefix
in a forked child so two gateway processes never share it.
"""

from __future__ import annotations

import itertools
import os
import secrets

_prefix = secrets.token_hex(8)
_counter = itertools.count(1)


def _reseed() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(8)
    _counter = itertools.count(1)


os.register_at_fork(after_in_child=_reseed)


def unique_hex() -> str:
    """32 hex digits, unique for this process's lifetime and across processes."""
    return f"{_prefix}{next(_counter):016x}"
