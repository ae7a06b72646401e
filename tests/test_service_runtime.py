"""The services' runtime pieces: the event loop choice (shared/event_loop.py) and the gateway's JSON
encoder (services/gateway/json_out.py)."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway import json_out
from services.gateway.sse import encode_event
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
