"""The services' runtime pieces: the event loop choice (shared/event_loop.py) and the gateway's JSON
encoder (services/gateway/http/json_out.py)."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.http import json_out
from services.gateway.http.errors import bad_request
from services.gateway.api.sse import DONE, encode_event, stream_events
from shared import event_loop


@pytest.mark.parametrize("obj", [
    {"text": "héllo ✓ 漢字 \U0001F600", "ids": [1, 2, 3], "f": 0.25, "none": None, "ok": True},
    {"nested": [{"a": [1.5, -2]}, []], "empty": {}},
    {"big": 2 ** 70},  # beyond 64 bits: orjson refuses, the fallback encodes it
    {1: "int key"},  # non-string keys become strings, as json.dumps does
    "a \"quoted\" \\ string\n",
])
def test_json_out_matches_the_standard_library(obj):
    expected = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    assert json.loads(json_out.dumps(obj)) == json.loads(expected)
    assert json_out.dumps(obj).decode() == expected


def test_sse_event_framing():
    assert encode_event({"x": "✓"}) == 'data: {"x":"✓"}\n\n'.encode()


async def _sse_writes(events, hold_headers=True) -> tuple[list[bytes], bytes]:
    """What stream_events hands the socket, one item per write, and the body the client reads."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    writes: list[bytes] = []

    async def handler(request):
        async def gen():
            for e in events:
                if isinstance(e, Exception):
                    raise e
                yield e
        transport = request.transport
        real = transport.write
        transport.write = lambda data: (writes.append(bytes(data)), real(data))[1]
        return await stream_events(request, gen(), hold_headers=hold_headers)

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/")).read()
    return writes, body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def test_sse_error_after_events_keeps_them():
    """An error after some events: those events, then one error event in place of the end marker (a
    generation stream's last increment going out with the end: tests/gateway/test_stream_push.py)."""
    a, b = {"i": 1}, {"i": 2}
    writes, body = await _sse_writes([a, b, bad_request("boom")])
    assert body.startswith(encode_event(a) + encode_event(b) + b"data: ") and b"boom" in body
    assert not body.endswith(DONE)
    assert writes[-1].endswith(b"\r\n0\r\n\r\n")  # the error event and the terminator in one write


async def test_sse_headers_go_out_with_the_first_event():
    a, b = {"i": 1}, {"i": 2}
    writes, body = await _sse_writes([a, b])
    assert body == encode_event(a) + encode_event(b) + DONE
    assert len(writes) == 3 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/event-stream; charset=utf-8\r\n" in writes[0]
    assert writes[0].endswith(b"\r\n\r\n" + _chunk(encode_event(a)))  # headers, then the first chunk
    assert writes[1:] == [_chunk(encode_event(b)), _chunk(DONE) + b"0\r\n\r\n"]
    # A stream that fails before its first event: the headers and the error event in one write.
    writes, body = await _sse_writes([bad_request("early")])
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK") and b"early" in body
    # A stream with nothing to say: the headers, the end marker and the terminator together.
    writes, body = await _sse_writes([])
    assert body == DONE and len(writes) == 1 and writes[0].endswith(_chunk(DONE) + b"0\r\n\r\n")
    # hold_headers=False: the headers first, on their own.
    writes, body = await _sse_writes([a], hold_headers=False)
    assert len(writes) == 3 and writes[0].endswith(b"\r\n\r\n") and b"data:" not in writes[0]
    assert body == encode_event(a) + DONE


async def test_sse_held_headers_wait_for_the_first_event_only_when_asked():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    for hold in (True, False):
        release = asyncio.Event()

        async def handler(request):
            async def gen():
                await release.wait()
                yield {"i": 1}
            return await stream_events(request, gen(), hold_headers=hold)

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            started = asyncio.ensure_future(client.get("/"))
            await asyncio.sleep(0.2)
            assert started.done() is not hold  # held: no status line before the first event
            release.set()
            resp = await started
            assert resp.status == 200 and await resp.read() == encode_event({"i": 1}) + DONE


async def test_sse_chunk_writer_writes_direct_only_while_the_client_keeps_up():
    """Events after the first go straight to the transport as aiohttp would frame them, unless the
    transport still holds data (a slow client: aiohttp's write and its flow control), is closing, or the
    response is not plain chunked (HTTP/1.0, compression)."""
    from services.gateway.api.sse import _ChunkWriter

    class Transport:
        def __init__(self):
            self.buffered, self.closing, self.writes = 0, False, []

        def get_write_buffer_size(self):
            return self.buffered

        def is_closing(self):
            return self.closing

        def write(self, data):
            self.writes.append(bytes(data))

    class Resp:
        def __init__(self, headers):
            self.headers, self.writes = headers, []

        async def write(self, data):
            self.writes.append(data)

    for headers, direct in (({"Transfer-Encoding": "chunked"}, True), ({}, False),
                            ({"Transfer-Encoding": "chunked", "Content-Encoding": "gzip"}, False)):
        t, resp = Transport(), Resp(headers)
        w = _ChunkWriter(type("Req", (), {"transport": t})(), resp)
        await w.write(b"first")  # carries the headers: always aiohttp's
        await w.write(b"second")
        t.buffered = 10
        await w.write(b"behind")
        t.buffered, t.closing = 0, True
        await w.write(b"closing")
        t.closing = False
        await w.write(b"again")
        if direct:
            assert resp.writes == [b"first", b"behind", b"closing"]
            assert t.writes == [_chunk(b"second"), _chunk(b"again")]
        else:
            assert resp.writes == [b"first", b"second", b"behind", b"closing", b"again"] and not t.writes


async def test_sse_over_http_1_0_is_not_chunked():
    """An HTTP/1.0 client gets the events unframed, the end by the connection closing."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def handler(request):
        async def gen():
            for i in range(3):
                yield {"i": i}
        return await stream_events(request, gen())

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    assert body == b"".join(encode_event({"i": i}) for i in range(3)) + DONE


def test_json_response_headers():
    r = json_out.json_response({"a": 1}, status=201, headers={"X-Request-Id": "r1"})
    assert r.status == 201 and r.body == b'{"a":1}'
    assert r.headers["Content-Type"] == "application/json; charset=utf-8" and r.headers["X-Request-Id"] == "r1"


def test_event_loop_choice(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.loop_factory() is uvloop.new_event_loop

    async def name():
        return event_loop.current_loop_name()
    assert event_loop.run(name()).startswith("uvloop")
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_factory() is None
    assert event_loop.run(name()).startswith("asyncio")
    monkeypatch.setenv(event_loop.ENV, "tokio")
    with pytest.raises(SystemExit, match="auto, uvloop or asyncio"):
        event_loop.loop_factory()
    assert not asyncio.get_event_loop_policy().__class__.__module__.startswith("uvloop")  # no global install
