"""The public port's HTTP behaviour on raw sockets (aiohttp alone serves it): keep-alive, pipelined and
split requests, Expect: 100-continue, Connection: close, half-closed connections, the refusals HTTP itself
makes (413, undecodable bodies), a slow-loris head (closed at the idle timeout, no task left behind), a
client that hangs up (aborted on the worker), request ids, keys and the access log, and a drain."""
import asyncio
import gzip
import json
import logging

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


async def _connect(stack):
    return await asyncio.open_connection(stack.server.host, stack.server.port)


async def test_keep_alive_serves_every_route_on_one_connection(stack):
    reader, writer = await _connect(stack)
    try:
        writer.write(_post("/generate", GENERATE))
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
        assert json.loads(body)["meta_info"]["completion_tokens"] == 3
        assert headers["x-request-id"] and "date" in headers
        writer.write(_post("/v1/completions", {**COMPLETION, "stream": True}))
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["content-type"] == "text/event-stream; charset=utf-8"
        events = sse_events(body.decode())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order(stack):
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
    finally:
        writer.close()


async def test_a_half_closed_connection_is_a_gone_client(stack):
    """As aiohttp has it: the server closes its side too and its request ends, nothing left in flight."""
    reader, writer = await _connect(stack)
    try:
        writer.write(_post("/generate", {**GENERATE, "rid": "half"}))
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
        for _ in range(100):
            if not stack.state.dispatcher.inflight:
                break
            await asyncio.sleep(0.02)
        assert not stack.state.dispatcher.inflight
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


async def test_refusals(stack):
    """Bad JSON and an oversized body get OpenAI error bodies; a request HTTP itself cannot frame gets
    aiohttp's plain 400; chunked bodies, HTTP/1.0 and query strings are served."""
    cases = [
        (_post("/generate", b"{not json"), 400),
        (_post("/generate", b"x" * (stack.state.limits.max_body_bytes + 1)), 413),
        (b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 3x\r\n\r\n{}", 400),
        (b"POST /generate HTTP/1.1\nHost: t\nContent-Length: 2\n\n{}", 400),
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
            if status >= 400 and headers.get("content-type", "").startswith("application/json"):
                error = json.loads(body)["error"]
                assert error["message"] and "type" in error, body
        finally:
            writer.close()


async def test_a_body_that_does_not_decode_is_a_400_not_a_500(stack):
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


async def test_an_unparsable_request_is_one_log_line(stack, caplog):
    """aiohttp logs a request it cannot frame with a traceback at ERROR; anyone can send those bytes, so
    each is one warning line (its newlines escaped), not a traceback per request."""
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    for raw in (b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n"):
        reader, writer = await _connect(stack)
        try:
            writer.write(raw)
            status, _, _ = await _read_response(reader)
            assert status == 400
        finally:
            writer.close()
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 2, records
    for r in records:
        assert r.levelno == logging.WARNING and not r.exc_info and "\n" not in r.getMessage(), r.getMessage()
    assert "Duplicate Content-Length" in records[0].getMessage()


async def test_a_body_that_stalls_is_a_408(stack):
    """Headers that promise more body than ever comes (the slow-loris of the body): the read gives up at
    its deadline with a 408, not a handler waiting forever on an open connection."""
    stack.state.limits.body_read_timeout_s = 0.3
    reader, writer = await _connect(stack)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\"")
        status, _, body = await _read_response(reader)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout", body
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


async def test_a_slow_loris_head_is_closed_at_the_idle_timeout_leaving_no_task(stack):
    server = stack.server.runner.server
    server._kwargs["keepalive_timeout"] = 0.3  # connections made from now on
    tasks_before = len(asyncio.all_tasks())
    reader, writer = await _connect(stack)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: t\r\n")  # and never the rest
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        for _ in range(100):
            if not server.connections and len(asyncio.all_tasks()) <= tasks_before:
                break
            await asyncio.sleep(0.02)
        assert not server.connections and len(asyncio.all_tasks()) <= tasks_before
    finally:
        writer.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_hangs_up_is_aborted_on_the_worker(stream):
    """Streamed (the next write fails) or not (the handler is cancelled when the connection drops)."""
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
        finally:
            writer.close()
        sent = [m for m in s.worker.received if isinstance(m, GenerateRequest) and m.rid.endswith("keyed")]
        assert sent and sent[0].rid != "keyed"  # the tenant's salt namespaces its rid and its cache
        lines = [r.getMessage() for r in caplog.records if r.name == "services.gateway.access"]
        assert any("request_id=my-id-1 POST /generate 200" in line for line in lines), lines
        assert any("POST /generate 401" in line for line in lines), lines


async def test_the_access_log_shows_the_path_as_sent(stack, caplog):
    """A percent-encoded newline in the path is decoded in request.path: logged as sent, it cannot forge
    an access-log line."""
    caplog.set_level(logging.INFO, logger="services.gateway.access")
    r = await stack.client.get("/v1/models/x%0aINFO%20forged%0d")
    assert r.status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "services.gateway.access"]
    assert any("get /v1/models/x%0ainfo%20forged%0d 404" in line.lower() for line in lines), lines
    assert not any("\n" in line or "\r" in line for line in lines), lines


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
