"""The event loop every service runs on: uvloop where it imports, asyncio's own otherwise.

The gateway and the workers spend their IO time in socket writes and callbacks (one SSE event per token
per stream, one frame per step per connection); uvloop does those in C. `RADIXSERVE_EVENT_LOOP=asyncio`
forces the standard loop (to compare, or to rule the loop out when debugging).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any, Coroutine

log = logging.getLogger(__name__)
ENV = "RADIXSERVE_EVENT_LOOP"


def loop_factory():
    """uvloop's loop factory, or None for asyncio's default loop."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "uvloop", "asyncio"):
        raise SystemExit(f"error: ${ENV} must be auto, uvloop or asyncio, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit(f"error: ${ENV}=uvloop but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run on the chosen loop."""
    factory = loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set: a service runs until it is set, then shuts down in order."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    return stop


def current_loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"
