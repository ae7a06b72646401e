"""The services' runtime pieces: the event loop choice (shared/event_loop.py) and the gateway's JSON
encoder (services/gateway/json_out.py)."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway import json_out
from services.gateway.errors import bad_request
from services.gateway.sse import DONE, Tail, encode_event, stream_events
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


async def test_sse_tail_events_go_out_with_the_end_in_one_write():
    a, b, c = {"i": 1}, {"i": 2}, {"usage": 3}
    writes, body = await _sse_writes([a, Tail(b), Tail(c)])
    assert body == encode_event(a) + encode_event(b) + encode_event(c) + DONE  # the same bytes as before
    assert len(writes) == 2 and writes[1].startswith(b"%x\r\n" % len(encode_event(b) + encode_event(c) + DONE))
    assert writes[1].endswith(b"\r\n0\r\n\r\n")  # the chunked terminator in the same write
    # A held event goes out with the next ordinary one; an error after a held event keeps it.
    writes, body = await _sse_writes([Tail(a), b])
    assert body == encode_event(a) + encode_event(b) + DONE and len(writes) == 2
    writes, body = await _sse_writes([a, Tail(b), bad_request("boom")])
    assert body.startswith(encode_event(a) + encode_event(b) + b"data: ") and b"boom" in body
    assert not body.endswith(DONE)


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
