"""shared/gc_freeze.py: the start-up heap leaves the collector's reach; later garbage is still collected."""
import gc
import weakref

from shared.gc_freeze import freeze_startup_heap, frozen_count, space_young_collections


class _Node:
    pass


def test_freeze_moves_the_heap_out_and_later_cycles_are_still_collected():
    try:
        assert freeze_startup_heap() > 1000
        survivor = _Node()
        survivor.self = survivor  # a cycle made after the freeze
        ref = weakref.ref(survivor)
        del survivor
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()


def test_young_collections_are_spaced_and_cycles_still_collected():
    before = gc.get_threshold()
    try:
        space_young_collections(5000)
        assert gc.get_threshold() == (5000, before[1], before[2])
        refs = []
        for _ in range(20_000):  # enough allocations for automatic collections alone to find the cycles
            node = _Node()
            node.self = node
            refs.append(weakref.ref(node))
        del node
        assert sum(r() is not None for r in refs) < 10_000
    finally:
        gc.set_threshold(*before)


def test_the_frozen_count_is_remembered_not_recounted(monkeypatch):
    """Workers report it on every info call (/metrics, /server_info): gc.get_freeze_count() walks the
    permanent generation under the GIL (~20 ms for a worker's heap), so it is counted once, at the freeze."""
    try:
        n = freeze_startup_heap()
        assert n > 1000

        def walk():
            raise AssertionError("counted again")
        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert frozen_count() == n
    finally:
        gc.unfreeze()


async def test_the_gateway_young_threshold_holds_hundreds_of_streams_in_flight():
    """A young collection is triggered by tracked objects allocated and not yet freed: the threshold is
    meant to sit above what 256 streams keep alive while they run, so that a burst of requests does not set
    off collections that walk every stream's objects (the fake worker's share counted too: an overestimate)."""
    import asyncio
    import json

    from shared.gc_freeze import GATEWAY_YOUNG_THRESHOLD
    from tests.fake_worker import gateway_stack

    streams = 16
    async with gateway_stack(token_delay=0.05) as s:
        conns = [await asyncio.open_connection(s.server.host, s.server.port) for _ in range(streams)]
        body = json.dumps({"model": "tiny", "prompt": list(range(1, 200)), "max_tokens": 40, "stream": True})
        gc.collect()
        before = len(gc.get_objects())
        for _, writer in conns:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%b" % (len(body), body.encode()))
        for reader, _ in conns:
            await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)  # every stream has its first event
        gc.collect()
        per_stream = (len(gc.get_objects()) - before) / streams
        for _, writer in conns:
            writer.close()
    assert 20 < per_stream and 256 * per_stream < GATEWAY_YOUNG_THRESHOLD, per_stream
