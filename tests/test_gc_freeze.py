"""shared/gc_freeze.py: the start-up heap leaves the collector's reach; later garbage is still collected."""
import gc
import weakref

from shared.gc_freeze import freeze_startup_heap


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
