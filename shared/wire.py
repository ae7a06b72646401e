"""Length-prefixed msgpack frames over asyncio streams."""
from __future__ import annotations

import asyncio
import struct

import msgpack

from shared.protocol import Message, ProtocolError, decode_message

MAX_FRAME = 256 * 1024 * 1024
_HEADER = struct.Struct("!I")


def encode_frame(msg: Message) -> bytes:
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError("frame too large")
    return _HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> Message:
    """Read and validate one frame. Raises asyncio.IncompleteReadError at EOF, ProtocolError on garbage."""
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit")
    body = await reader.readexactly(size)
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=MAX_FRAME)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ProtocolError(f"undecodable frame: {e}") from None
    return decode_message(obj)


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    writer.write(encode_frame(msg))
    await writer.drain()
