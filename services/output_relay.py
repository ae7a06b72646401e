"""A child process's stderr, relayed to ours with the child's name in front of every line.

Workers print their progress bars (weight loading, CUDA graph capture) and logs on stderr; under the
launcher several of them share one terminal, so each line, and each progress-bar redraw (tqdm ends those
with a carriage return), gets a `[prefill-0] ` prefix. The copying runs in a thread on a plain pipe: a
slow or absent reader of our stderr can stall only that thread (and then the child), never the
launcher's event loop.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from typing import BinaryIO

_LINE_END = re.compile(rb"[\r\n]")


class PrefixedRelay:
    def __init__(self, name: str, sink: BinaryIO | None = None):
        self.prefix = f"[{name}] ".encode()
        self.sink = sink
        self._read_fd, self.write_fd = os.pipe()
        self._thread = threading.Thread(target=self._copy, daemon=True, name=f"relay-{name}")

    def child_started(self) -> None:
        """Call once the child holds the write end: ours closes, so the relay ends when the child does."""
        os.close(self.write_fd)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _copy(self) -> None:
        sink = self.sink or sys.stderr.buffer
        pending = b""
        with os.fdopen(self._read_fd, "rb", buffering=0) as src:
            while chunk := src.read(65536):
                pending += chunk
                out, pending = _split(pending, self.prefix)
                if out:
                    _write(sink, out)
        if pending:
            _write(sink, self.prefix + pending + b"\n")


def _split(data: bytes, prefix: bytes) -> tuple[bytes, bytes]:
    """Prefixed complete lines (ended by \\n, \\r or \\r\\n), and the unfinished rest."""
    out, start = [], 0
    for m in _LINE_END.finditer(data):
        end = m.end()
        if data[m.start():end] == b"\r" and (end == len(data) or data[end:end + 1] == b"\n"):
            continue  # \r\n (or a \r that may be its start): the \n ends it
        if end > start:
            out.append(prefix + data[start:end])
        start = end
    return b"".join(out), data[start:]


def _write(sink: BinaryIO, data: bytes) -> None:
    try:
        sink.write(data)
        sink.flush()
    except (OSError, ValueError):
        pass  # our stderr is gone: drop the output, keep draining so the child never blocks
