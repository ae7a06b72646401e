"""The HTTP stack's own floor under the gateway's streaming load: what a server that does nothing but read
the request and stream the events costs per request, with the gateway's work taken away.

Three bare servers, each in its own process, driven by the same client and load as
`bench.gateway_overhead` (bench.serving.run_load: 512-token prompts, `--tokens` per stream, one SSE event
per `--stream-interval` tokens of a `--step-ms` step, then the usage chunk and [DONE] in one write):

- `aiohttp`: an aiohttp + uvloop application with one route, the body parsed with orjson, the events
  written to the transport directly (as services/gateway/sse.py does while the client keeps up);
- `aiohttp-lowlevel`: aiohttp's low-level `web.Server` (a handler; no Application, router or middlewares);
- `protocol`: an asyncio.Protocol on uvloop with a minimal HTTP/1.1 reader (Content-Length bodies,
  keep-alive) and chunked writes: no web framework at all.

    python -m bench.http_floor [--streams 1024 --concurrency 256 --tokens 128 --stream-interval 16 --rounds 2]

Prints each server's CPU per request and per output token (from /proc, its whole process), alternated
round by round; compare with `python -m bench.gateway_overhead` on the same machine in the same minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


class _Ticker:
    """The fake engine: every step, each stream whose turn it is gets its next event."""

    def __init__(self, step_s: float, interval: int, tokens: int):
        import orjson

        self.step_s, self.interval, self.tokens = step_s, interval, tokens
        self.streams: dict[int, list] = {}
        self.next_id = 0
        self.event = b"data: " + orjson.dumps({
            "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " tok" * interval, "logprobs": None, "finish_reason": None}]}) + b"\n\n"
        self.tail = b"data: " + orjson.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [],
                                             "usage": {"prompt_tokens": 512, "completion_tokens": tokens}}) \
            + b"\n\ndata: [DONE]\n\n"

    def add(self, write) -> None:
        self.next_id += 1
        self.streams[self.next_id] = [write, 0]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for key, st in list(self.streams.items()):
                st[1] += 1
                n = st[1]
                if n >= self.tokens:
                    st[0](self.event + self.tail, True)
                    del self.streams[key]
                elif n == 1 or (n - 1) % self.interval == 0:
                    st[0](self.event, False)


def _chunk(data: bytes, last: bool) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if last else b"")


def _run(listen, ticker: _Ticker) -> None:
    """On uvloop: `await listen()` (the server is up; it returns the port it bound), start the fake engine,
    say READY and the port, serve until killed."""
    import uvloop

    async def main() -> None:
        port = await listen()
        asyncio.get_running_loop().create_task(ticker.run())
        print(f"READY {port}", flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())


def _aiohttp_handler(ticker: _Ticker):
    """The one request handler both aiohttp servers run: read the body, stream the events to the transport."""
    import orjson
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        orjson.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        done = asyncio.get_running_loop().create_future()
        transport = request.transport

        def write(data: bytes, last: bool) -> None:
            transport.write(_chunk(data, False))
            if last:
                done.set_result(None)
        ticker.add(write)
        await done
        await resp.write_eof()
        return resp
    return handler


def serve_aiohttp(port: int, ticker: _Ticker) -> None:
    from aiohttp import web

    async def listen() -> int:
        app = web.Application()
        app.router.add_post("/v1/completions", _aiohttp_handler(ticker))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner.addresses[0][1]
    _run(listen, ticker)


def serve_aiohttp_lowlevel(port: int, ticker: _Ticker) -> None:
    """aiohttp's low-level server (web.Server: a request handler, no Application, router or middlewares)."""
    from aiohttp import web

    async def listen() -> int:
        server = web.Server(_aiohttp_handler(ticker), access_log=None)
        srv = await asyncio.get_running_loop().create_server(server, "127.0.0.1", port)
        return srv.sockets[0].getsockname()[1]
    _run(listen, ticker)


def serve_protocol(port: int, ticker: _Ticker) -> None:
    import orjson

    class Conn(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end].lower()
                at = head.find(b"content-length:")
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15:stop if stop > 0 else None]) if at >= 0 else 0
                if len(self.buf) < end + 4 + length:
                    return
                body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
                orjson.loads(body)
                self.transport.write(HEAD)
                transport = self.transport
                ticker.add(lambda data, last: transport.write(_chunk(data, last)))

    async def listen() -> int:
        srv = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port)
        return srv.sockets[0].getsockname()[1]
    _run(listen, ticker)


KINDS = ("aiohttp", "aiohttp-lowlevel", "protocol")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stream-interval", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=37.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)  # 0: the server picks
    args = ap.parse_args()
    if args.serve:
        ticker = _Ticker(args.step_ms / 1000, args.stream_interval, args.tokens)
        {"aiohttp": serve_aiohttp, "aiohttp-lowlevel": serve_aiohttp_lowlevel,
         "protocol": serve_protocol}[args.serve](args.port, ticker)
        return 0

    from bench.serving import run_load, summarize
    from shared import procfs

    rng = random.Random(0)
    dataset = [([rng.randrange(10, 400) for _ in range(512)], args.tokens) for _ in range(args.streams)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    for rnd in range(args.rounds):
        for kind in KINDS:
            proc = subprocess.Popen([sys.executable, "-m", "bench.http_floor", "--serve", kind,
                                     "--tokens", str(args.tokens), "--stream-interval", str(args.stream_interval),
                                     "--step-ms", str(args.step_ms)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            try:
                ready = proc.stdout.readline()
                assert ready.startswith("READY"), f"{kind} server did not start"
                port = int(ready.split()[1])  # bound by the server itself: no port race
                url = f"http://127.0.0.1:{port}"
                asyncio.run(run_load(url, "completions", dataset[:8], True, float("inf"), 0))
                c0, t0 = procfs.run_seconds(proc.pid), time.perf_counter()
                results, wall = asyncio.run(run_load(url, "completions", dataset, True, float("inf"), args.concurrency))
                cpu = procfs.run_seconds(proc.pid) - c0
                s = summarize(results, wall)
                print(f"round {rnd + 1} {kind:16s}: {cpu * 1e6 / len(results):5.0f} us/request, "
                      f"{cpu * 1e6 / max(1, s['out_tokens']):5.2f} us/token, {s['out_tok_s']:.0f} out tok/s, "
                      f"tokens {s['out_tokens']}, errors {s['errors']}", flush=True)
            finally:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
