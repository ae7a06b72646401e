"""Every runtime tunable, declared once: its name, type, default and why.

A knob NAME is read from the environment variable RADIXSERVE_<NAME> (unset: its default) when the module that uses
it is imported, into a module constant of the same name (kernels.gemv.SPLIT_K_MIN_PROGRAMS, ...): a process
started with `RADIXSERVE_SPLIT_K_MIN_PROGRAMS=1.5` runs with that value, and a test may still patch the module
constant. A value that does not parse as the knob's type stops the import with an error naming the variable.
`python -m shared.knobs` lists them all with their current values. A RADIXSERVE_ variable that names no knob (a
deleted or misspelt one, which would otherwise change nothing without a word) is warned about when this module is
first imported, and flagged by the listing.

Engine settings a user picks (batch sizes, fusions, attention backend) are EngineConfig fields and CLI flags, not
knobs; knobs are the thresholds a kernel or scheduler change is tuned by, left settable for the next measurement.

kernels/ stays pure (tests/kernels/test_layering.py) and may import this one module: it is a leaf of the standard
library alone. Passing each value in from the callers instead would thread thresholds read deep inside kernel launches
(split-K planning, the split count of decode attention) through every model and backend call in between.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys

PREFIX = "RADIXSERVE_"
# RADIXSERVE_ variables that are not knobs (settings read by their own modules).
OTHER_VARIABLES = frozenset({"RADIXSERVE_INTERNAL_KEY", "RADIXSERVE_EVENT_LOOP"})


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: bool | int | float
    module: str  # where it is read
    why: str


KNOBS = {k.name: k for k in (
    # kernels/
    Knob("GEMV_MAX_M", int, 16, "kernels.ops",
         "bf16 rows up to which a linear takes the decode GEMV rather than cuBLAS"),
    Knob("GEMV_MAX_M_FP8", int, 16, "kernels.ops",
         "FP8 (per-row scales) rows up to which a linear takes the weight-only GEMV rather than W8A8 _scaled_mm"),
    Knob("SPLIT_K_MIN_PROGRAMS", float, 2.0, "kernels.gemv",
         "GEMV programs an SM below which K is split (more programs keep every SM's memory pipe busy)"),
    Knob("MIN_PROGRAMS_PER_SM", float, 2.0, "kernels.fp8_block_gemm",
         "block-scaled FP8 GEMM programs an SM below which K is split (0: never split)"),
    Knob("PROGRAMS_PER_SM", int, 4, "kernels.attention.triton_decode",
         "decode attention stage-1 programs an SM that the split plan of a batch size aims for"),
    Knob("MIN_TOKENS_PER_SPLIT", int, 64, "kernels.attention.triton_decode",
         "context tokens a decode-attention chunk holds at least (short contexts take fewer chunks)"),
    Knob("TMA_MIN_TOKENS", int, 256, "kernels.attention.triton_extend",
         "new tokens of a pass's longest request from which extend attention loads them by TMA (Hopper)"),
    Knob("MIN_TOKENS_PER_PREFIX_SPLIT", int, 256, "kernels.attention.triton_cascade",
         "shared-prefix tokens a cascade-attention chunk holds at least"),
    Knob("MAX_PREFIX_SPLITS", int, 4, "kernels.attention.triton_cascade",
         "chunks a group's shared prefix is cut into at most (more only multiply the partial outputs' traffic)"),
    # shared/
    Knob("DECODE_TAIL_MIN_EMPTY_PROGRAMS", int, 4096, "shared.models.attention.triton_backend",
         "empty extend-grid programs an extend pass's one-token rows must save to run on the decode kernel"),
    Knob("CASCADE_MIN_BS", int, 16, "shared.engine.cuda_graph",
         "smallest decode batch captured with a cascade (shared-prefix) graph too"),
    Knob("LONG_MAX_TOKENS", int, 512, "shared.engine.extend_graph",
         "largest token bucket of the long-extend CUDA graphs (0: none; the engine's flag bounds it too)"),
    Knob("LONG_REQS", int, 4, "shared.engine.extend_graph",
         "request rows of a long-extend CUDA graph"),
    Knob("INBATCH_SHARE_TOKENS", int, 32, "shared.engine.prefill_adder",
         "equal next tokens that make requests of one admission round siblings (computed once)"),
    Knob("MAX_SIBLING_DEFERRALS", int, 2, "shared.engine.prefill_adder",
         "rounds a request waits at most for a sibling's pass"),
    Knob("COMPILE_ON_CUDA", bool, True, "shared.engine.sampler",
         "the sampler's noise + race as one torch.compile'd kernel on CUDA (0: eager, the same draws)"),
    Knob("GATEWAY_YOUNG_THRESHOLD", int, 50_000, "shared.gc_freeze",
         "the gateway's young-generation GC threshold (fewer collections stalling its event loop)"),
    Knob("KV_STREAM_MAXLEN", int, 10_000, "shared.metadata.kv_events",
         "entries a worker's KV event stream keeps (about): how far behind a reader may fall before a resync"),
    Knob("KV_SNAPSHOT_S", float, 1.0, "shared.metadata.kv_events",
         "seconds between snapshots of a worker's block set (when it changed): a new reader's catch-up"),
    Knob("KV_EVENT_BUFFER", int, 65_536, "shared.metadata.kv_events",
         "radix-tree events the engine thread may leave unpublished before the worker drops to a resync"),
    Knob("KV_INDEX_ROUTING", bool, True, "services.gateway.routing.cache_aware",
         "0: the gateway routes on its approximate index even while the KV events are current (they audit it)"),
)}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class KnobError(ValueError):
    pass


def _parse(k: Knob, text: str) -> bool | int | float:
    s = text.strip().lower()
    if k.type is bool:
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
    else:
        try:
            return k.type(s.replace("_", ""))
        except ValueError:
            pass
    expected = {bool: "1/0, true/false, yes/no or on/off", int: "an integer", float: "a number"}[k.type]
    raise KnobError(f"${PREFIX}{k.name}={text!r}: expected {expected} ({k.why})")


def knob(name: str) -> bool | int | float:
    """The knob's value: RADIXSERVE_<name> parsed as its type, or its default where unset or empty."""
    k = KNOBS[name]
    text = os.environ.get(PREFIX + name, "")
    return _parse(k, text) if text.strip() else k.default


def unknown_variables(environ=None) -> list[str]:
    """RADIXSERVE_ variables set that name no knob and no other setting."""
    environ = os.environ if environ is None else environ
    return sorted(v for v in environ if v.startswith(PREFIX) and v not in OTHER_VARIABLES
                  and v[len(PREFIX):] not in KNOBS)


for _name in unknown_variables():
    logging.getLogger(__name__).warning("$%s is set but names no knob: it is ignored (python -m shared.knobs lists "
                                        "them)", _name)


def main() -> int:
    rows = [("name", "type", "default", "value", "read by", "why")]
    bad = []
    for k in KNOBS.values():
        try:
            value = repr(knob(k.name))
        except KnobError as e:
            value = "INVALID"
            bad.append(str(e))
        rows.append((PREFIX + k.name, k.type.__name__, repr(k.default), value, k.module, k.why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    for msg in bad:
        print("error: " + msg, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
