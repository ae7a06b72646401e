"""Length-prefixed msgpack frames (shared/protocol.py's codec) over asyncio streams, and the opening
handshake of worker connections.

Every connection to a worker opens with a Hello frame carrying the shared internal key; the worker reads
that frame with a tiny size cap and drops the connection unless the key matches, so an unauthenticated
peer can make it allocate nothing and run nothing (admin frames such as flush_cache included).
"""
from __future__ import annotations

import asyncio
import hmac
import os
import struct

from shared import protocol
from shared.protocol import Hello, Message, ProtocolError

MAX_FRAME = 256 * 1024 * 1024  # what a gateway accepts from its workers (long logprob answers)
WORKER_MAX_FRAME = 32 * 1024 * 1024  # what a worker accepts from an authenticated gateway
HELLO_MAX_FRAME = 4096  # before authentication
HELLO_TIMEOUT_S = 10.0
INTERNAL_KEY_ENV = "RADIXSERVE_INTERNAL_KEY"
_HEADER = struct.Struct("!I")


def internal_key(flag: str | None = None) -> str:
    """The internal key: the flag when given, else $RADIXSERVE_INTERNAL_KEY, else "" (no key: open)."""
    return flag if flag is not None else os.environ.get(INTERNAL_KEY_ENV, "")


def key_matches(expected: str, offered: str) -> bool:
    return hmac.compare_digest(expected.encode("utf-8", "surrogatepass"), offered.encode("utf-8", "surrogatepass"))


async def accept_hello(reader: asyncio.StreamReader, key: str) -> None:
    """Server side of the handshake: the first frame must be a Hello with the right key (ProtocolError
    otherwise; a peer that says nothing times out)."""
    async with asyncio.timeout(HELLO_TIMEOUT_S):
        msg = await read_message(reader, HELLO_MAX_FRAME)
    if not isinstance(msg, Hello):
        raise ProtocolError(f"expected a hello frame first, got {msg.TYPE!r}")
    if not key_matches(key, msg.key):
        raise ProtocolError("wrong internal key")


def encode_frame(msg: Message) -> bytearray:
    """The length prefix and the message, encoded in place behind it (one buffer, no concatenation)."""
    frame = bytearray(_HEADER.size)
    protocol.encode_into(msg, frame, _HEADER.size)
    size = len(frame) - _HEADER.size
    if size > MAX_FRAME:
        raise ProtocolError("frame too large")
    _HEADER.pack_into(frame, 0, size)
    return frame


async def read_message(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> Message:
    """Read and validate one frame. Raises asyncio.IncompleteReadError at EOF, ProtocolError on garbage
    or on a length prefix above `max_size` (checked before anything is allocated)."""
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > max_size:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_size}")
    return protocol.decode(await reader.readexactly(size))


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    writer.write(encode_frame(msg))
    await writer.drain()
