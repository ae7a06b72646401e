"""Malformed input on every worker port (unified, prefill, decode, and the decode worker's UCX KV port):
garbage, a huge length prefix, no or a wrong internal key, bad msgpack, wrong types, unknown types. Each
costs the sender its connection and nothing else: no memory is taken for a frame that is refused, no
admin frame runs unauthenticated, and the worker serves the next request of the real gateway."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import struct

import msgpack
import pytest
import requests

from shared.protocol import FlushCacheRequest, GenerateRequest, Hello, InfoRequest, KvHeader, TokenOutputs
from shared.sampling_params import SamplingParams
from shared.wire import encode_frame, read_message
from tests.support.stack import free_port, wait_for
from tests.faults.procs import Proc, gateway, worker

pytestmark = pytest.mark.e2e

KEY = "fault-suite-key"
ENV = {"RADIXSERVE_INTERNAL_KEY": KEY}


def _frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


HELLO = encode_frame(Hello(key=KEY))
UNAUTHENTICATED = {
    "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "huge length": struct.pack("!I", 250 * 1024 * 1024) + b"x" * 1024,
    "no hello": encode_frame(InfoRequest(call_id=1)),
    "flush without hello": encode_frame(FlushCacheRequest(call_id=7)),
    "empty key": encode_frame(Hello(key="")) + encode_frame(FlushCacheRequest(call_id=7)),
    "wrong key": encode_frame(Hello(key="guess")) + encode_frame(FlushCacheRequest(call_id=7)),
    "bad msgpack hello": b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",
    "hello of wrong type": _frame({"type": "hello", "key": 12345}),
}
AUTHENTICATED = {
    "huge length": struct.pack("!I", 2 ** 31) + b"x",
    "bad msgpack": b"\x00\x00\x00\x03\xc1\xc1\xc1",
    "not a map": _frame([1, 2, 3]),
    "unknown type": _frame({"type": "exec", "code": "import os"}),
    "wrong field type": _frame({"type": "generate", "rid": 5, "input_ids": [1], "sampling": {}}),
    "wrong list type": _frame({"type": "generate", "rid": "r", "input_ids": ["a"], "sampling": {}}),
    "missing field": _frame({"type": "generate", "rid": "r"}),
    "unknown field": _frame({"type": "ping", "call_id": 1, "cmd": "x"}),
}


async def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


async def _dropped(host: str, port: int, payload: bytes, timeout: float = 15) -> bytes:
    """Send payload on a fresh connection; return what came back before the worker closed it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:  # closed with our unread bytes still queued: a reset, same verdict
        return b""
    finally:
        writer.close()


async def _info(host: str, port: int) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(HELLO + encode_frame(InfoRequest(call_id=1)))
    msg = await asyncio.wait_for(read_message(reader), 15)
    writer.close()
    return msg.info


async def _scenario(host: str, port: int, pid: int) -> None:
    rss0 = await _rss_kb(pid)
    for name, payload in UNAUTHENTICATED.items():
        data = await _dropped(host, port, payload)
        assert data == b"", f"{name}: the worker answered an unauthenticated peer: {data[:80]!r}"
    for name, payload in AUTHENTICATED.items():
        data = await _dropped(host, port, HELLO + payload)
        assert data == b"", f"{name}: {data[:80]!r}"
    # Three 250 MB length prefixes take no memory: the cap is checked before reading the body.
    for _ in range(3):
        await _dropped(host, port, HELLO + struct.pack("!I", 250 * 1024 * 1024) + b"y" * 65536)
    assert await _rss_kb(pid) - rss0 < 100 * 1024
    info = await _info(host, port)
    assert info["num_running"] == 0 and info["kv_usage"] == 0.0
    # A request that is well-formed on the wire but nonsense for the engine is refused, not crashed on.
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(HELLO + encode_frame(GenerateRequest(rid="huge-top", input_ids=[5, 6, 7],
                                                      sampling=SamplingParams(max_new_tokens=2),
                                                      return_logprob=True, top_logprobs_num=1_000_000)))
    out = await asyncio.wait_for(read_message(reader), 30)
    writer.close()
    assert isinstance(out, TokenOutputs) and out.outputs[-1].finished and out.outputs[-1].refused


@pytest.fixture(scope="module")
def pd_fleet():
    with cf.ThreadPoolExecutor(2) as ex:  # the two workers start side by side
        starts = [ex.submit(worker, "--role", role, env=ENV) for role in ("prefill", "decode")]
    for f in starts:
        if f.exception() is not None:
            for other in starts:
                if other.exception() is None:
                    other.result()[0].stop()
            raise f.exception()
    (prefill, ph, pp), (decode, dh, dp) = (f.result() for f in starts)
    gw, url = gateway(f"{ph}:{pp},{dh}:{dp}", env=ENV)
    yield {"prefill": (prefill, ph, pp), "decode": (decode, dh, dp), "url": url}
    for p in (gw, prefill, decode):
        p.stop()


def _generate_ok(url: str) -> None:
    r = requests.post(url + "/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 4}},
                      timeout=60)
    assert r.status_code == 200, r.text


def test_unified_worker_port():
    w, host, port = worker(env=ENV)
    try:
        asyncio.run(_scenario(host, port, w.proc.pid))
        assert w.alive()
        gw, url = gateway(f"{host}:{port}", env=ENV)
        try:
            _generate_ok(url)
        finally:
            gw.stop()
    finally:
        w.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_worker_ports(pd_fleet, role):
    proc, host, port = pd_fleet[role]
    asyncio.run(_scenario(host, port, proc.proc.pid))
    assert proc.alive()
    _generate_ok(pd_fleet["url"])


def test_gateway_without_the_key_is_refused(pd_fleet):
    """A gateway that does not know the key never becomes healthy (every connection is dropped)."""
    proc, host, port = pd_fleet["decode"]
    gw_port = free_port()
    gw = Proc("services.gateway", "--model-path", "tiny-random", "--workers", f"{host}:{port}", "--port",
              str(gw_port), "--log-level", "warning", ready="gateway ready", env={"RADIXSERVE_INTERNAL_KEY": "nope"})
    try:
        wait_for(lambda: any("wrong internal key" in line for line in proc.lines), 10,
                 "the worker to refuse the gateway's hello")
        r = requests.get(f"http://127.0.0.1:{gw_port}/health", timeout=5)
        assert r.status_code == 503
    finally:
        gw.stop()


async def _ucx_scenario(host: str, port: int) -> None:
    from shared.pd.ucx import _recv_msg, _send_msg, _ucxx
    from shared.protocol import KvAccept

    for key in ("", "wrong"):
        ep = await _ucxx().create_endpoint(host, port)
        header = KvHeader(transfer_id=f"probe-{key}", prompt_len=4, layout=[1, 2, 1, 1], dtype="float32", key=key)
        await _send_msg(ep, header)
        with pytest.raises(Exception):
            async with asyncio.timeout(5):
                await _recv_msg(ep, KvAccept)


def test_decode_kv_port(pd_fleet):
    proc, host, port = pd_fleet["decode"]
    r = requests.get(pd_fleet["url"] + "/server_info", timeout=30).json()
    decode_info = next(w["info"] for w in r["workers"] if w["info"] and w["info"].get("role") == "decode")
    transfer_port = decode_info["transfer_addr"][1]
    # Raw TCP garbage at the UCX listener, then KV headers without the key.
    for payload in (b"\x00" * 64, struct.pack("!Q", 2 ** 60) + b"zz"):
        try:
            asyncio.run(_dropped(host, transfer_port, payload, timeout=2))
        except (OSError, asyncio.TimeoutError):
            pass
    asyncio.run(_ucx_scenario(host, transfer_port))
    info = requests.get(pd_fleet["url"] + "/server_info", timeout=30).json()
    stats = next(w["info"]["kv_transfer"] for w in info["workers"] if w["info"] and w["info"].get("role") == "decode")
    assert stats["refused"] >= 2, stats
    assert proc.alive()
    _generate_ok(pd_fleet["url"])
