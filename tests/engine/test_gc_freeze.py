"""shared/gc_freeze.py: the start-up heap leaves the collector's reach; later garbage is still collected."""
import gc
import weakref

import pytest

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
    from tests.support.fake_worker import gateway_stack

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


def test_collections_paused_restores_the_collector_and_collects_first_when_asked():
    from shared.gc_freeze import collections_paused

    assert gc.isenabled()
    node = _Node()
    node.self = node
    ref = weakref.ref(node)
    del node
    with collections_paused(collect_first=True):
        assert ref() is None  # collected before the block
        assert not gc.isenabled()
        with collections_paused():  # nested: the outer pause survives the inner one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with collections_paused():
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # a collector disabled before stays disabled
    finally:
        gc.enable()


def test_capture_graph_captures_with_automatic_collection_paused(monkeypatch):
    """Collections are allowed in the warm-up runs and paused in the capture (a finalizer of an earlier graph or
    Triton kernel run mid-capture invalidates it); the collector is back on after, also when capture fails."""
    import contextlib

    import torch

    from shared.engine import cuda_graph

    seen = []
    capturing = []

    @contextlib.contextmanager
    def fake_graph(g, pool=None, stream=None):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.pop()

    class _Stream:
        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)

    def forward():
        seen.append((bool(capturing), gc.isenabled()))

    cuda_graph.capture_graph(forward, _Stream(), None)
    assert seen == [(False, True), (False, True), (True, False)]
    assert gc.isenabled()

    def failing():
        if capturing:
            raise RuntimeError("capture invalidated")
    try:
        cuda_graph.capture_graph(failing, _Stream(), None)
    except RuntimeError:
        pass
    assert gc.isenabled()


def _collection_mid_capture(capture):
    """Captures a graph with `capture(forward, stream)` while a collection falls due inside the capture with an
    earlier graph in cyclic garbage (the young generation's threshold at 1); returns what the replay computed."""
    import torch

    x = torch.zeros(16, device="cuda")
    stale = torch.cuda.CUDAGraph()
    with torch.cuda.graph(stale):
        x.mul_(1)
    stale_graphs = [stale]
    del stale

    def forward():
        x.add_(1)
        if torch.cuda.is_current_stream_capturing() and stale_graphs:
            holder = _Node()
            holder.graph, holder.self = stale_graphs.pop(), holder
            del holder
            for _ in range(100):  # container allocations: any of them may set off a young collection
                _Node()

    before = gc.get_threshold()
    gc.set_threshold(1, before[1], before[2])
    try:
        g = capture(forward, torch.cuda.Stream())
    finally:
        gc.set_threshold(*before)
    g.replay()
    torch.cuda.synchronize()
    return x[0].item()


@pytest.mark.gpu
def test_a_collection_due_mid_capture_does_not_reach_the_capture():
    from shared.engine.cuda_graph import capture_graph

    assert _collection_mid_capture(lambda f, s: capture_graph(f, s, None)) == 3.0  # two warm-ups, one replay
    gc.collect()


def test_graph_runners_capture_every_graph_with_collection_paused(monkeypatch):
    """The decode and extend runners capture their whole loop of graphs (warm-ups included) with automatic collection
    paused, after one collection, and leave the collector on (checked without a GPU: capture_graph stubbed)."""
    from types import SimpleNamespace

    import torch

    from shared.engine import cuda_graph, extend_graph

    seen = []

    class _Graph:
        def pool(self):
            return None

    def capture(forward, stream, pool):
        seen.append(gc.isenabled())
        return _Graph()
    monkeypatch.setattr(cuda_graph, "capture_graph", capture)  # both runners capture through cuda_graph.capture_graphs
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(len(seen)) or real_collect(*a))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8, vocab_size=16), logits_dtype=torch.float32)
    cpu = torch.device("cpu")
    ext = extend_graph.ExtendGraphRunner(model, None, None, None, max_tokens=64, max_reqs=4, dtype=torch.float32,
                                         device=cpu, progress=False)
    dec = cuda_graph.CudaGraphRunner(model, None, None, None, SimpleNamespace(graph_cascade=lambda: False), max_bs=8,
                                     device=cpu, progress=False)
    assert len(seen) == len(ext.sizes) + len(dec.sizes) > 4
    assert not any(seen) and gc.isenabled()
    assert collected == [0, len(ext.sizes)]  # once before each runner's loop


def test_graph_runners_name_their_limit_when_a_capture_runs_out_of_memory(monkeypatch):
    """A capture that runs out of GPU memory stops start-up with the runner's own message: the decode runner names
    the batch size and --cuda-graph-max-bs, the extend runner the token count and --cuda-graph-max-extend-tokens
    (checked without a GPU: capture_graph stubbed to fail); the collector is left on."""
    from types import SimpleNamespace

    import pytest
    import torch

    from shared.engine import cuda_graph, extend_graph

    def capture(forward, stream, pool):
        raise torch.OutOfMemoryError("stub")
    monkeypatch.setattr(cuda_graph, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8, vocab_size=16), logits_dtype=torch.float32)
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"extend CUDA graph of 64 tokens.*--cuda-graph-max-extend-tokens"):
        extend_graph.ExtendGraphRunner(model, None, None, None, max_tokens=64, max_reqs=4, dtype=torch.float32,
                                       device=cpu, progress=False)
    with pytest.raises(RuntimeError, match=r"decode CUDA graph of batch size 8 beside.*--cuda-graph-max-bs \(now 8\)"):
        cuda_graph.CudaGraphRunner(model, None, None, None, SimpleNamespace(graph_cascade=lambda: False), max_bs=8,
                                   device=cpu, progress=False)
    assert gc.isenabled()
