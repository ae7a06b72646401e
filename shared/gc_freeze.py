"""Long-lived processes take their start-up heap out of the cyclic garbage collector.

torch, the model, the tokenizer and the web stack leave some 250k objects behind at start-up, and every
full collection walks all of them with the GIL held (0.2-0.3 s on a 2-core machine): every stream of the
process stalls that long (twice in 60 steps of bench/wire.py's 256-stream run, where the outputs that
stay alive across a step push objects into the oldest generation). gc.freeze() once the process is ready
moves them to a permanent generation that collections skip; whatever serving allocates afterwards is
collected as usual.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up garbage once, then freeze what is left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
