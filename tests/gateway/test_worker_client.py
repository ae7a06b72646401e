"""WorkerClient (multiplexing, failure handling, timeouts) and Router (affinity, load) against a real
protocol-speaking fake worker."""
import asyncio
from contextlib import aclosing

import pytest

from services.gateway.http.errors import APIError, WorkerUnavailable
from services.gateway.routing.affinity import PrefixAffinityPolicy
from services.gateway.routing.router import Router
from services.gateway.routing.worker_client import WorkerClient, parse_worker_list
from shared.protocol import (AbortRequest, FinishLength, FinishStop, GenerateRequest, PongResult, TokenOutput,
                             TokenOutputs)
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from shared.wire import encode_frame, read_message
from tests.support.fake_worker import FakeWorker

TOK = Tokenizer.load("tiny-random")


def req(rid, ids=(5, 6, 7), max_new_tokens=4, **kw):
    return GenerateRequest(rid=rid, input_ids=list(ids),
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, **kw))


async def collect(client, r):
    outs = []
    async with aclosing(client.generate(r)) as stream:
        async for out in stream:
            outs.append(out)
    return outs


@pytest.fixture
async def worker():
    w = FakeWorker(TOK)
    await w.start()
    yield w
    await w.stop()


@pytest.fixture
async def client(worker):
    c = WorkerClient("127.0.0.1", worker.port, connect_timeout=1.0, call_timeout=0.5, token_timeout=2.0)
    yield c
    await c.close()


async def test_concurrent_streams_are_demultiplexed(worker, client):
    a, b = await asyncio.gather(collect(client, req("a", (5, 6), 6)), collect(client, req("b", (9,), 3)))
    assert [t for o in a for t in o.token_ids] == worker.expected_ids([5, 6], 6)
    assert [t for o in b for t in o.token_ids] == worker.expected_ids([9], 3)
    assert a[-1].finished and a[-1].finish_reason == FinishLength(length=6)
    assert all(o.rid == "a" for o in a) and all(o.rid == "b" for o in b)
    assert client.load == 0


async def test_info_and_flush(client):
    info = await client.info()
    assert info["max_context_len"] == 256
    assert (await client.flush_cache()).ok


async def test_load_counts_in_flight_requests(worker, client):
    worker.token_delay = 0.05
    stream = client.generate(req("slow", max_new_tokens=50))
    await stream.__anext__()
    assert client.load == 1
    await stream.aclose()
    assert client.load == 0


async def test_leaving_early_sends_abort(worker, client):
    worker.token_delay = 0.02
    async with aclosing(client.generate(req("early", max_new_tokens=100))) as stream:
        async for _ in stream:
            break
    for _ in range(100):
        if "early" in worker.aborted():
            break
        await asyncio.sleep(0.01)
    assert "early" in worker.aborted()
    assert "early" not in worker.finished_rids


async def test_finished_stream_sends_no_abort(worker, client):
    await collect(client, req("done"))
    await asyncio.sleep(0.05)
    assert not any(isinstance(m, AbortRequest) for m in worker.received)


async def test_lost_connection_fails_pending_streams_then_reconnects(worker, client):
    worker.token_delay = 0.05

    async def consume(rid):
        return await collect(client, req(rid, max_new_tokens=100))

    tasks = [asyncio.create_task(consume(r)) for r in ("x", "y")]
    await asyncio.sleep(0.15)
    await worker.drop_connections()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2.0)
    assert all(isinstance(r, WorkerUnavailable) for r in results), results
    assert client.load == 0
    worker.token_delay = 0.0
    outs = await asyncio.wait_for(collect(client, req("after")), 3.0)  # reconnected with backoff
    assert outs[-1].finished


async def test_silent_worker_times_out(worker, client):
    await client.info()  # connected
    worker.silent = True
    with pytest.raises(WorkerUnavailable):
        await client.info()
    client.token_timeout = 0.3
    with pytest.raises(WorkerUnavailable, match="sent nothing"):
        await collect(client, req("hang"))
    # The worker may still hold the request's KV: a silence timeout aborts it there (a lost connection
    # would not: nothing is left to abort).
    for _ in range(50):
        if "hang" in worker.aborted():
            break
        await asyncio.sleep(0.01)
    assert "hang" in worker.aborted()


async def test_unreachable_worker_fails_fast():
    w = FakeWorker(TOK)
    port = await w.start()
    await w.stop()  # nothing listens there any more
    c = WorkerClient("127.0.0.1", port, connect_timeout=0.3, call_timeout=0.3)
    try:
        with pytest.raises(WorkerUnavailable):
            await asyncio.wait_for(collect(c, req("nobody")), 2.0)
        with pytest.raises(WorkerUnavailable):
            await asyncio.wait_for(c.info(), 2.0)
    finally:
        await c.close()


async def test_duplicate_rid_on_one_connection_is_refused(worker, client):
    worker.token_delay = 0.05
    first = client.generate(req("dup", max_new_tokens=20))
    await first.__anext__()
    with pytest.raises(ValueError):
        await client.generate(req("dup")).__anext__()
    await first.aclose()


async def test_frames_of_one_turn_go_out_in_one_write_in_order(worker, client):
    """Requests sent in the same event-loop turn reach the socket as one write; an abort posted in that
    turn follows its request, never overtakes it; the worker gets every frame."""
    worker.token_delay = 0.02
    await client.info()  # connected
    writes = []
    real_write = client._writer.write
    client._writer.write = lambda data: (writes.append(bytes(data)), real_write(data))[1]
    streams = [client.generate(req(f"t{i}", max_new_tokens=50)) for i in range(3)]
    firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await asyncio.gather(*firsts)
    assert writes == [b"".join(encode_frame(req(f"t{i}", max_new_tokens=50)) for i in range(3))]
    writes.clear()
    for s in streams:  # leaving early: one abort each, posted in this turn, written together
        await s.aclose()
    await asyncio.sleep(0.05)
    assert len(writes) == 1 and writes[0] == b"".join(encode_frame(AbortRequest(rid=f"t{i}")) for i in range(3))
    assert {"t0", "t1", "t2"} <= worker.aborted()
    order = [(type(m).__name__, m.rid) for m in worker.received if hasattr(m, "rid")]
    assert order.index(("GenerateRequest", "t0")) < order.index(("AbortRequest", "t0"))


async def test_a_request_and_its_abort_in_one_turn_arrive_in_order(worker, client):
    """A stream closed before its request was written: the request and the abort go out together, the
    request first, so the worker cancels what it started."""
    worker.token_delay = 0.02
    await client.info()
    stream = client.generate(req("quick", max_new_tokens=50))
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the request is posted, not yet written
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()
    for _ in range(100):
        if "quick" in worker.aborted():
            break
        await asyncio.sleep(0.01)
    order = [type(m).__name__ for m in worker.received if getattr(m, "rid", None) == "quick"]
    assert order == ["GenerateRequest", "AbortRequest"]
    assert "quick" not in worker.running


async def test_frames_posted_for_a_lost_connection_are_not_sent_on_the_next(worker, client):
    await client.info()
    stream = client.generate(req("lost", max_new_tokens=50))
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # posted
    client.drop_connection("test")
    with pytest.raises(WorkerUnavailable):
        await first
    await stream.aclose()
    await client.info()  # reconnected
    assert not [m for m in worker.received if getattr(m, "rid", None) == "lost"]


async def test_a_batched_frame_reaches_each_requests_stream():
    """A worker sends one TokenOutputs frame per engine step for all of a connection's requests: each
    output lands in its own stream, in order; an output for a request nobody waits for is dropped."""
    got_requests: asyncio.Queue = asyncio.Queue()

    async def serve(reader, writer):
        await read_message(reader)  # hello
        ping = await read_message(reader)
        writer.write(encode_frame(PongResult(call_id=ping.call_id)))
        rids = sorted([(await read_message(reader)).rid for _ in range(2)])
        await got_requests.put(rids)
        a, b = rids
        writer.write(encode_frame(TokenOutputs(outputs=[
            TokenOutput(rid=a, token_ids=[1], text="a1"), TokenOutput(rid="ghost", token_ids=[9], text="?"),
            TokenOutput(rid=b, token_ids=[2], text="b1"),
            TokenOutput(rid=a, token_ids=[3], text="a2", finished=True, finish_reason=FinishLength(length=2))])))
        writer.write(encode_frame(TokenOutputs(outputs=[
            TokenOutput(rid=b, token_ids=[4], text="b2", finished=True, finish_reason=FinishStop(matched=4))])))
        await writer.drain()
        await reader.read()  # until the client goes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    c = WorkerClient("127.0.0.1", server.sockets[0].getsockname()[1], connect_timeout=2.0, token_timeout=5.0)
    try:
        a, b = await asyncio.wait_for(asyncio.gather(collect(c, req("a")), collect(c, req("b"))), 10)
        assert await got_requests.get() == ["a", "b"]
        # a1 and a2 arrive in one frame: queued together, they reach the consumer as one increment.
        assert [(o.text, o.token_ids, o.finished) for o in a] == [("a1a2", [1, 3], True)]
        assert "".join(o.text for o in b) == "b1b2" and [o.finished for o in b][-1] and b[-1].token_ids[-1] == 4
        assert a[-1].finish_reason == FinishLength(length=2) and b[-1].finish_reason == FinishStop(matched=4)
        assert c.load == 0
    finally:
        await c.close()
        server.close()
        await server.wait_closed()


async def test_a_consumer_that_falls_behind_gets_the_queued_tokens_as_one_increment():
    """Outputs queued while the consumer was busy are folded into one increment (one SSE event for many
    tokens), nothing lost or reordered; a consumer that keeps up sees every increment on its own."""
    steps = 12

    async def serve(reader, writer):
        await read_message(reader)  # hello
        ping = await read_message(reader)
        writer.write(encode_frame(PongResult(call_id=ping.call_id)))
        for _ in range(2):
            rid = (await read_message(reader)).rid
            for i in range(steps):
                last = i == steps - 1
                writer.write(encode_frame(TokenOutputs(outputs=[TokenOutput(
                    rid=rid, token_ids=[i], text=f"{i},", finished=last, completion_tokens=i + 1,
                    finish_reason=FinishLength(length=steps) if last else None)])))
                await writer.drain()
                await asyncio.sleep(0.01)
        await reader.read()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    c = WorkerClient("127.0.0.1", server.sockets[0].getsockname()[1], connect_timeout=2.0, token_timeout=5.0)
    try:
        slow = []
        async for out in c.generate(req("slow")):
            slow.append(out)
            await asyncio.sleep(0.05)  # a slow client: ~5 steps arrive per event it takes
        assert [t for o in slow for t in o.token_ids] == list(range(steps))
        assert "".join(o.text for o in slow) == "".join(f"{i}," for i in range(steps))
        assert 2 <= len(slow) < steps and slow[-1].finished and slow[-1].completion_tokens == steps
        fast = [o async for o in c.generate(req("fast"))]
        assert [t for o in fast for t in o.token_ids] == list(range(steps))
        assert len(fast) > len(slow)  # kept up (mostly): about one increment per step
    finally:
        await c.close()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------- router
class StubWorker:
    def __init__(self, address, load=0, connected=True, role="unified", kv_format=""):
        self.address, self.load, self.connected = address, load, connected
        self.kv_format = kv_format
        self.responsive = True
        self.draining = False
        self.role = role
        self.transfer_addr = ("127.0.0.1", 1) if role == "decode" else None

    @property
    def routable(self):
        return self.connected and self.responsive and not self.draining

    def start(self):
        pass


def test_router_sends_nothing_new_to_a_draining_worker():
    a, b = StubWorker("a:1"), StubWorker("b:1")
    d0, d1 = StubWorker("d0:1", role="decode"), StubWorker("d1:1", role="decode")
    p = StubWorker("p:1", role="prefill")
    router, pd = Router([a, b]), Router([p, d0, d1])
    a.draining = d0.draining = True
    assert all(router.pick([i]) is b for i in range(20))
    assert all(pd.pick_pair([i])[1] is d1 for i in range(20))


def test_router_pairs_prefill_with_decode_and_never_sends_whole_requests_to_prefill():
    p0, p1 = StubWorker("p0:1", role="prefill"), StubWorker("p1:1", role="prefill")
    d0 = StubWorker("d0:1", role="decode")
    router = Router([p0, p1, d0])
    for i in range(20):
        pair = router.pick_pair([i, i + 1])
        assert pair[0].role == "prefill" and pair[1] is d0
        assert router.pick([i]) is d0  # requests served whole (input logprobs) go to decode
    assert {router.pick_pair([i, 7])[0].address for i in range(50)} == {"p0:1", "p1:1"}
    d0.connected = False
    assert router.pick_pair([1, 2]) is None  # no decode side: no PD
    only_prefill = Router([p0])
    assert only_prefill.pick_pair([1]) is None
    with pytest.raises(APIError) as e:
        only_prefill.pick([1])
    assert e.value.status == 503


def test_prefix_affinity_is_sticky_and_spreads():
    workers = [StubWorker(f"w{i}:1") for i in range(4)]
    router = Router(workers, PrefixAffinityPolicy(prefix_tokens=8, slack=2))
    head = list(range(8))
    picks = {router.pick(head + [100 + i]).address for i in range(20)}
    assert len(picks) == 1  # same first 8 tokens -> same worker
    spread = {router.pick([i, i + 1, i + 2]).address for i in range(200)}
    assert len(spread) == 4  # different heads use every worker


def test_affinity_yields_to_load_beyond_slack():
    workers = [StubWorker("a:1"), StubWorker("b:1")]
    router = Router(workers, PrefixAffinityPolicy(prefix_tokens=4, slack=2))
    ids = [1, 2, 3, 4]
    home = router.pick(ids)
    other = next(w for w in workers if w is not home)
    home.load = 2
    assert router.pick(ids) is home  # within slack
    home.load = 3
    assert router.pick(ids) is other


def test_cache_aware_keeps_conversations_home_despite_a_shared_system_prompt():
    from services.gateway.routing.cache_aware import CacheAwarePolicy

    workers = [StubWorker(f"w{i}:1") for i in range(4)]
    router = Router(workers, CacheAwarePolicy(block_tokens=4, slack=2))
    system = list(range(100, 140))  # every conversation starts with these 40 tokens
    convs = []
    for c in range(12):
        turn1 = system + [1000 + c] * 8
        w = router.pick(turn1)
        w.load += 1  # still running: later conversations spread by load
        convs.append((w, turn1))
    assert len({w.address for w, _ in convs}) >= 3
    for w in workers:
        w.load = 0
    for w, turn1 in convs:  # idle fleet: each next turn goes where its history is
        assert router.pick(turn1 + [7] * 8) is w
    # A flush (or a worker leaving) forgets what was where.
    router.forget_cache()
    assert len({router.pick(turn1 + [9] * 8).address for _, turn1 in convs}) == 1  # head hash: one home


def test_salt_separates_tenants():
    workers = [StubWorker(f"w{i}:1") for i in range(8)]
    router = Router(workers)
    ids = [1, 2, 3]
    assert len({router.pick(ids, salt=f"tenant{i}").address for i in range(40)}) > 1


def test_router_skips_disconnected_and_updates_workers():
    a, b = StubWorker("a:1", connected=False), StubWorker("b:1")
    router = Router([a, b])
    assert all(router.pick([i]) is b for i in range(20))
    c = StubWorker("c:1")
    gone = router.set_workers([b, c])
    assert gone == [a] and router.workers == [b, c]
    router.set_workers([])
    with pytest.raises(APIError) as e:
        router.pick([1])
    assert e.value.status == 503


def test_parse_worker_list():
    assert parse_worker_list("127.0.0.1:5000, host:6000") == [("127.0.0.1", 5000), ("host", 6000)]
    for bad in ("", "nohost", "h:x"):
        with pytest.raises(ValueError):
            parse_worker_list(bad)


def test_cache_aware_pair_routing_hashes_the_prompt_once(monkeypatch):
    from services.gateway.routing import cache_aware

    calls = []
    real = cache_aware.block_chain
    monkeypatch.setattr(cache_aware, "block_chain", lambda *a: calls.append(1) or real(*a))
    router = Router([StubWorker("p:1", role="prefill"), StubWorker("d:1", role="decode")],
                    cache_aware.CacheAwarePolicy(block_tokens=4))
    ids = list(range(64))
    router.pick_pair(ids)
    assert len(calls) == 1
    router.pick_pair(list(ids))  # another request with the same tokens is hashed afresh
    assert len(calls) == 2


async def test_dispatcher_pushes_increments_from_the_read_loop(worker, client):
    """A Run's increments reach its consumer by a plain call from the worker connection's read loop (no
    task of the request's in between), each with its index and the result so far; closing an unfinished
    run aborts on the worker, and leaves nothing in flight."""
    from services.gateway.routing.dispatch import Dispatcher
    from services.gateway.http.metrics import GatewayMetrics

    d = Dispatcher(Router([client]), GatewayMetrics("m"))

    class Recorder:
        def __init__(self):
            self.got, self.done = [], asyncio.Event()

        def deliver(self, gen, item):
            res = gen.accept(item)
            self.got.append((gen.index, list(item.token_ids), list(res.output_ids), asyncio.current_task().get_name()))
            if all(g.result.finished for g in run.generations):
                self.done.set()

    rec = Recorder()
    run = d.run([req("a", (5,), 2), req("b", (6,), 4)], rec)
    await run.start()
    assert set(d.inflight) == {"a", "b"}
    await asyncio.wait_for(rec.done.wait(), 5)
    await run.close()
    assert {task for *_, task in rec.got} == {f"worker-{client.address}"}  # called in the read loop's turn
    for i, ids, n in ((0, [5], 2), (1, [6], 4)):
        mine = [(new, acc) for j, new, acc, _ in rec.got if j == i]
        assert [t for new, _ in mine for t in new] == worker.expected_ids(ids, n) == mine[-1][1]
    assert not d.inflight and client.load == 0
    assert not worker.aborted()  # both finished: nothing to abort
    # A run closed before its requests finish aborts them on the worker.
    worker.token_delay = 0.05
    run = d.run([req("c", (7,), 100)], Recorder())
    await run.start()
    await asyncio.sleep(0.12)
    await run.close()
    for _ in range(100):
        if "c" in worker.aborted():
            break
        await asyncio.sleep(0.01)
    assert "c" in worker.aborted() and not d.inflight and client.load == 0


async def test_collect_many_raises_the_first_failure_and_aborts_the_rest(worker, client):
    from services.gateway.routing.dispatch import Dispatcher
    from services.gateway.http.metrics import GatewayMetrics

    d = Dispatcher(Router([client]), GatewayMetrics("m"))
    results = await d.collect_many([req("x", (5,), 3), req("y", (6,), 1)])
    assert [r.rid for r in results] == ["x", "y"] and [len(r.output_ids) for r in results] == [3, 1]
    worker.token_delay = 0.02
    worker.error_after = 3
    with pytest.raises(APIError) as e:
        await d.collect_many([req("p", (5,), 50), req("q", (6,), 50)])
    assert e.value.status == 400 and e.value.message == "worker exploded"
    assert not d.inflight and client.load == 0


class _FlushableEngine:
    """What WorkerServer asks of an engine to answer pings and flushes."""
    steps = 0
    on_output = None

    class policy:
        @staticmethod
        def num_running() -> int:
            return 0

    def call(self, fn):
        from concurrent.futures import Future
        f = Future()
        f.set_result(fn())
        return f

    def flush_cache(self):
        return True, "cache flushed"


async def test_a_flush_or_a_restart_resets_every_gateways_picture_of_the_worker():
    """Two gateways (two processes of a pool, or two gateways on one fleet) route prompts to one real
    worker server; one flushes its cache: both forget what they thought it held (the worker's cache id
    changes and goes out unasked). A worker restarted on the same port comes with a new id too."""
    from services.gateway.routing.cache_aware import CacheAwarePolicy
    from services.worker.server import WorkerServer

    server = WorkerServer(_FlushableEngine(), internal_key="k")
    port = await server.start("127.0.0.1", 0)
    clients = [WorkerClient("127.0.0.1", port, internal_key="k", connect_timeout=2.0) for _ in range(2)]
    # Each fleet has a second worker (never started): a fleet of one keeps no routing index at all.
    routers = [Router([c, WorkerClient("127.0.0.1", 9, internal_key="k")], CacheAwarePolicy()) for c in clients]
    try:
        for c in clients:
            c.start()
        ids = list(range(10, 90))
        for c, r in zip(clients, routers):
            r.remember(c, ids, None)
            assert c.address in r.policy._index
        while not all(c.connected and c.cache_id for c in clients):
            await asyncio.sleep(0.01)
        first = clients[1].cache_id
        assert (await clients[0].flush_cache()).ok
        for _ in range(200):
            if all(c.address not in r.policy._index for c, r in zip(clients, routers)):
                break
            await asyncio.sleep(0.01)
        assert all(c.address not in r.policy._index for c, r in zip(clients, routers))
        assert clients[1].cache_id != first
        # The same address, a new process (a supervisor's restart): the reconnecting gateway forgets too.
        routers[1].remember(clients[1], ids, None)
        await server.close()
        server = WorkerServer(_FlushableEngine(), internal_key="k")
        await server.start("127.0.0.1", port)
        for c in clients:
            c.drop_connection("the worker restarted")  # as its process's death would
        clients[1].kick()
        for _ in range(300):
            if clients[1].address not in routers[1].policy._index:
                break
            await asyncio.sleep(0.02)
        assert clients[1].address not in routers[1].policy._index
    finally:
        for c in clients:
            await c.close()
        await server.close()


def test_a_fleet_of_one_unified_worker_keeps_no_routing_index():
    """Nothing to choose between: the cache-aware index is not kept (its upkeep was ~30 us a request);
    with a second worker it is."""
    from services.gateway.routing.affinity import PrefixAffinityPolicy
    from services.gateway.routing.cache_aware import CacheAwarePolicy

    solo = WorkerClient("127.0.0.1", 9)
    ids = list(range(100))
    router = Router([solo], CacheAwarePolicy())
    assert router.pick(ids) is solo
    router.remember(solo, ids + [1, 2], None, prompt=ids)
    assert router.policy._index == {} and not router.remembers(solo)  # (the dispatcher builds no list)
    pair = Router([solo, WorkerClient("127.0.0.1", 10)], CacheAwarePolicy())
    assert pair.remembers(solo) and not pair.remembers(WorkerClient("127.0.0.1", 11))
    pair.remember(solo, ids, None)
    assert solo.address in pair.policy._index
    assert not Router([solo, WorkerClient("127.0.0.1", 10)], PrefixAffinityPolicy()).remembers(solo)
