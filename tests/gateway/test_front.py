"""The generation routes' HTTP front (services/gateway/front.py) on raw sockets: what it serves itself,
what it hands to aiohttp and when (pipelined requests in order across the handover), Expect:
100-continue, keep-alive and Connection: close, the refusals a client gets either way, a client that
hangs up (aborted on the worker), and its request ids, auth and access log."""
import asyncio
import gc
import json
import logging
import weakref

import pytest

from shared.protocol import GenerateRequest
from tests.support.fake_worker import gateway_stack, sse_events


def _post(path: str, body, *, extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST %b %b\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
            % (path.encode(), version, len(data), extra, data))


GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 3}}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if status == 100:
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), 10)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10)
    return status, headers, body


@pytest.fixture
async def stack():
    async with gateway_stack() as s:
        yield s


def _front(stack):
    return stack.server.runner.server


async def _connect(stack):
    return await asyncio.open_connection(stack.server.host, stack.server.port)


async def test_the_front_serves_the_generation_routes_and_aiohttp_the_rest(stack):
    front = _front(stack)
    before = front.served
    reader, writer = await _connect(stack)
    try:
        writer.write(_post("/generate", GENERATE))
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
        assert json.loads(body)["meta_info"]["completion_tokens"] == 3
        assert headers["x-request-id"] and "date" in headers
        assert front.served == before + 1
        # Keep-alive: the same connection, a streamed completion.
        writer.write(_post("/v1/completions", {**COMPLETION, "stream": True}))
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(body.decode())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert front.served == before + 2 and front.handed_over == 0
        # Anything else: the connection goes to aiohttp, and stays with it.
        writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, _ = await _read_response(reader)
        assert status == 200 and front.handed_over == 1
        writer.write(_post("/generate", GENERATE))
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 3
        assert front.served == before + 2
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order_across_the_handover(stack):
    """Three requests in one write: the front's, aiohttp's, then one the front would serve - which aiohttp
    now serves, after the first two are answered, in order."""
    reader, writer = await _connect(stack)
    try:
        writer.write(_post("/generate", {**GENERATE, "rid": "first"})
                     + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
                     + _post("/generate", {**GENERATE, "rid": "third"}))
        answers = [await _read_response(reader) for _ in range(3)]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert json.loads(answers[0][2])["meta_info"]["id"] == "first"
        assert json.loads(answers[1][2])["object"] == "list"
        assert json.loads(answers[2][2])["meta_info"]["id"] == "third"
    finally:
        writer.close()


async def test_a_request_split_across_writes_and_two_in_one(stack):
    reader, writer = await _connect(stack)
    try:
        raw = _post("/generate", {**GENERATE, "rid": "split"})
        for i in range(0, len(raw), 7):  # head and body a few bytes at a time
            writer.write(raw[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        status, _, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["meta_info"]["id"] == "split"
        writer.write(_post("/generate", {**GENERATE, "rid": "a"}) + _post("/generate", {**GENERATE, "rid": "b"}))
        ids = [json.loads((await _read_response(reader))[2])["meta_info"]["id"] for _ in range(2)]
        assert ids == ["a", "b"]
        assert _front(stack).handed_over == 0
    finally:
        writer.close()


async def test_expect_100_continue(stack):
    reader, writer = await _connect(stack)
    try:
        raw = _post("/generate", GENERATE, extra=b"Expect: 100-continue\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        status, _, _ = await _read_response(reader)
        assert status == 100
        writer.write(body)
        status, _, answer = await _read_response(reader)
        assert status == 200 and json.loads(answer)["meta_info"]["completion_tokens"] == 3
    finally:
        writer.close()


async def test_refusals_are_the_same_on_both_paths(stack):
    """A body the front does not read (chunked, oversized, an unparsable length, HTTP/1.0) goes to aiohttp,
    which answers it as before (a request HTTP itself cannot frame gets aiohttp's plain-text 400); bad
    JSON is refused by the route on the front, with an OpenAI error body."""
    cases = [
        (_post("/generate", b"{not json"), 400),
        (_post("/generate", b"x" * (stack.state.limits.max_body_bytes + 1)), 413),
        (b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 3x\r\n\r\n{}", 400),
        (b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
         + b"%x\r\n%b\r\n0\r\n\r\n" % (len(json.dumps(GENERATE)), json.dumps(GENERATE).encode()), 200),
        (_post("/generate", GENERATE, version=b"HTTP/1.0"), 200),
        (_post("/generate?x=1", GENERATE), 200),
        (_post("/v1/completions", {"model": "tiny"}), 400),
    ]
    for raw, expected in cases:
        reader, writer = await _connect(stack)
        try:
            writer.write(raw)
            status, headers, body = await _read_response(reader)
            assert status == expected, (raw[:60], status, body[:200])
            if status >= 400 and b"3x" not in raw:
                error = json.loads(body)["error"]
                assert error["message"] and "type" in error, body
        finally:
            writer.close()


async def test_heads_the_front_does_not_read_exactly_are_answered_by_aiohttp_at_once(stack):
    """Found by differential fuzzing (the same bytes to a gateway with the front and one without): a head
    with bare-LF line ends never shows CRLF CRLF, and the front waited for it until the idle timeout; a
    head without Host or with two Content-Types the front served where aiohttp refuses. All go to aiohttp
    now, as the first line ending arrives."""
    front = _front(stack)
    body = json.dumps(GENERATE).encode()
    cases = [
        b"POST /generate HTTP/1.1\nHost: t\nContent-Length: %d\n\n%b" % (len(body), body),
        b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body),
        _post("/generate", body, extra=b"Content-Type: text/plain\r\n"),
    ]
    for raw in cases:
        before = front.handed_over
        reader, writer = await _connect(stack)
        try:
            writer.write(raw)
            status, _, _ = await _read_response(reader)  # within its 10 s, not the idle timeout
            assert status == 400, raw
            assert front.handed_over == before + 1
        finally:
            writer.close()


async def test_the_stack_without_the_front_is_aiohttp_alone():
    """tests/support/fuzz_front.py compares against gateway_stack(front=False): it must not have the front."""
    from services.gateway.front import FrontServer

    async with gateway_stack(front=False) as s:
        assert not isinstance(s.server.runner.server, FrontServer)
        resp = await s.client.post("/generate", json=GENERATE)
        assert resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 3


async def test_a_body_aiohttp_cannot_decode_is_a_400_not_a_500(stack):
    """Content-Encoding goes to aiohttp, which inflates the body; one that does not inflate was a 500."""
    import gzip

    body = json.dumps(GENERATE).encode()
    for data, expected in ((body, 400), (gzip.compress(body), 200)):
        reader, writer = await _connect(stack)
        try:
            writer.write(_post("/generate", data, extra=b"Content-Encoding: gzip\r\n"))
            status, _, raw = await _read_response(reader)
            assert status == expected, raw
            if expected == 400:
                error = json.loads(raw)["error"]
                assert error["code"] == "invalid_body" and "content-encoding" in error["message"], error
        finally:
            writer.close()


async def test_connection_close_is_honoured(stack):
    reader, writer = await _connect(stack)
    try:
        writer.write(_post("/generate", GENERATE, extra=b"Connection: close\r\n"))
        status, headers, _ = await _read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the server closed its side
    finally:
        writer.close()


async def test_the_serving_task_starts_with_the_first_request(stack):
    front = _front(stack)
    reader, writer = await _connect(stack)
    try:
        for _ in range(100):
            if front.connections:
                break
            await asyncio.sleep(0.01)
        [conn] = front.connections
        assert conn._task is None  # connected, nothing sent: no task
        writer.write(_post("/generate", GENERATE))
        assert (await _read_response(reader))[0] == 200
        assert conn._task is not None and not conn._task.done()  # kept for the next request
        writer.write(_post("/generate", GENERATE))
        assert (await _read_response(reader))[0] == 200
    finally:
        writer.close()


async def test_a_connection_closed_between_requests_leaves_no_cyclic_garbage(stack):
    """Every client that closes its keep-alive connection: the protocol and its task are freed by their
    reference counts (a cancelled task's CancelledError held them in a cycle until a collection)."""
    front = _front(stack)
    reader, writer = await _connect(stack)
    gc.disable()
    try:
        writer.write(_post("/generate", GENERATE))
        assert (await _read_response(reader))[0] == 200
        [conn] = front.connections
        gone, task = weakref.ref(conn), weakref.ref(conn._task)
        del conn
        writer.close()
        for _ in range(100):
            if gone() is None:
                break
            await asyncio.sleep(0.01)
        assert gone() is None and task() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_hangs_up_is_aborted_on_the_worker(stream):
    """Streamed (the next write fails) or not (nothing is written until the end: the handler is cancelled
    when the connection drops)."""
    async with gateway_stack(token_delay=0.02) as s:
        reader, writer = await _connect(s)
        writer.write(_post("/generate", {"text": "long", "rid": "gone", "stream": stream,
                                         "sampling_params": {"max_new_tokens": 200}}))
        if stream:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)  # the first event
        else:
            for _ in range(200):
                if any(isinstance(m, GenerateRequest) and m.rid == "gone" for m in s.worker.received):
                    break
                await asyncio.sleep(0.01)
        writer.close()
        for _ in range(200):
            if "gone" in s.worker.aborted():
                break
            await asyncio.sleep(0.02)
        assert "gone" in s.worker.aborted()
        for _ in range(100):
            if not s.state.dispatcher.inflight:
                break
            await asyncio.sleep(0.02)
        assert not s.state.dispatcher.inflight


async def test_keys_request_ids_and_the_access_log(caplog):
    async with gateway_stack(api_key="sekret") as s:
        caplog.set_level(logging.INFO, logger="services.gateway.access")
        reader, writer = await _connect(s)
        try:
            writer.write(_post("/generate", GENERATE))
            status, _, body = await _read_response(reader)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
            writer.write(_post("/generate", {**GENERATE, "rid": "keyed"},
                               extra=b"Authorization: Bearer sekret\r\nX-Request-Id: my-id-1\r\n"))
            status, headers, _ = await _read_response(reader)
            assert status == 200 and headers["x-request-id"] == "my-id-1"
            assert _front(s).handed_over == 0
        finally:
            writer.close()
        sent = [m for m in s.worker.received if isinstance(m, GenerateRequest) and m.rid.endswith("keyed")]
        assert sent and sent[0].rid != "keyed"  # the tenant's salt namespaces its rid and its cache
        lines = [r.getMessage() for r in caplog.records if r.name == "services.gateway.access"]
        assert any("request_id=my-id-1 POST /generate 200" in line for line in lines), lines
        assert any("POST /generate 401" in line for line in lines), lines


async def test_shutdown_lets_a_stream_in_flight_finish():
    async with gateway_stack(token_delay=0.01) as s:
        reader, writer = await _connect(s)
        writer.write(_post("/generate", {"text": "drain", "stream": True, "sampling_params": {"max_new_tokens": 40}}))
        await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)  # in flight
        idle_reader, idle_writer = await _connect(s)  # a keep-alive connection with nothing in flight
        cleanup = asyncio.create_task(s.server.close())
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # closed at once
        rest = await asyncio.wait_for(reader.read(), 10)  # the stream runs to its end, then the close
        assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest[-80:]
        await asyncio.wait_for(cleanup, 10)
        writer.close()
        idle_writer.close()


def test_response_header_lines_are_encoded_once_and_newlines_refused(monkeypatch):
    from services.gateway import front

    monkeypatch.setattr(front, "_LINES", {})
    head = front._response_head(200, [("Content-Type", "text/event-stream"), ("Warning", '299 x "é"')], "rid-1",
                                False, b"Transfer-Encoding: chunked\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nDate: ")
    assert head.endswith(b'Content-Type: text/event-stream\r\nWarning: 299 x "\xc3\xa9"\r\nX-Request-Id: rid-1\r\n\r\n')
    assert front._response_head(200, [("Content-Type", "text/event-stream")], "rid-2", True, b"").endswith(
        b"Content-Type: text/event-stream\r\nX-Request-Id: rid-2\r\nConnection: close\r\n\r\n")
    assert len(front._LINES) == 2
    monkeypatch.setattr(front, "_MAX_LINES", 2)
    assert front._header_line("A", "b") == b"A: b\r\n" and len(front._LINES) == 2  # full: encoded, not kept
    for name, value in (("Warning", "a\r\nSet-Cookie: x"), ("X\n", "v")):
        with pytest.raises(ValueError):
            front._header_line(name, value)
