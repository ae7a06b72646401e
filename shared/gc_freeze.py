"""Long-lived processes take their start-up heap out of the cyclic garbage collector.

torch, the model, the tokenizer and the web stack leave some 250k objects behind at start-up, and every
full collection walks all of them with the GIL held (0.2-0.3 s on a 2-core machine): every stream of the
process stalls that long (twice in 60 steps of bench/wire.py's 256-stream run, where the outputs that
stay alive across a step push objects into the oldest generation). gc.freeze() once the process is ready
moves them to a permanent generation that collections skip; whatever serving allocates afterwards is
collected as usual.

The gateway also collects its youngest generation less often (`space_young_collections`): it allocates a
few hundred containers per request, so at Python's default (a collection every 700) one ran every couple
of requests and promoted every in-flight request's objects (prompt lists of hundreds of ids) into the
middle generation, whose collections then walked them again at ~2.5 ms each: some 10% of the gateway's
CPU at 256 streams. The count that triggers a young collection is of tracked objects allocated and not
yet freed, so what matters is the live set: a streamed request keeps ~65 tracked objects (its coroutines,
protocol, result, prompt list...) alive until it ends, 17k for 256 streams. At 10,000 every burst of 256
requests set off a collection that walked all of them (~3 ms each, ~15 us a request on the bench's
gateway); at 50,000 the in-flight set of several hundred streams fits below it, so young collections come
from real growth (or cyclic garbage) and see mostly objects that are gone; cycles are still found, later.

CUDA graph capture runs with automatic collection paused (`collections_paused`): since torch 2.9
`torch.cuda.graph` no longer collects before capturing, so a collection that fires mid-capture can
finalize an earlier graph (cudaGraphExecDestroy) or a discarded Triton kernel (cuModuleUnload), calls a
capturing stream forbids: the capture is invalidated ("operation failed due to a previous error during
capture"). Seen on the H200 when an FP8-KV runner was built in a process that had just dropped another.
"""
from __future__ import annotations

import contextlib
import gc

from shared.knobs import knob

_frozen = 0  # objects frozen by this process's freeze_startup_heap


def freeze_startup_heap() -> int:
    """Collect start-up garbage once, then freeze what is left; returns how many objects are frozen."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def frozen_count() -> int:
    """What freeze_startup_heap froze, as counted then. Not gc.get_freeze_count(): that walks the whole
    permanent generation with the GIL held (CPython counts the list's length node by node, a pointer chase
    through objects scattered over the heap): ~21 ms for the tiny model's worker (246k frozen objects) on
    a 2-core machine, more with a real model's; a worker that asked it on every info call stalled its
    engine thread that long at each /metrics scrape and /server_info."""
    return _frozen


GATEWAY_YOUNG_THRESHOLD = knob("GATEWAY_YOUNG_THRESHOLD")


def space_young_collections(threshold: int = GATEWAY_YOUNG_THRESHOLD) -> None:
    """Collect the youngest generation every `threshold` container allocations (the older generations'
    ratios unchanged)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)


@contextlib.contextmanager
def collections_paused(collect_first: bool = False):
    """No automatic collection inside the block; the collector's state is restored after it (also on an
    error). collect_first: one full collection before, so that garbage from before the block (stale graphs,
    replaced kernels) is finalized now rather than after it."""
    if collect_first:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
