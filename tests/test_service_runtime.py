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


async def _sse_writes(events) -> tuple[list[bytes], bytes]:
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
        return await stream_events(request, gen())

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/")).read()
    return writes[1:], body  # [0]: the headers


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
