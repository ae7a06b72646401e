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
