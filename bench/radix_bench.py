"""Host-side cost of the radix prefix cache at serving scale (CPU only, no KV buffers).

Builds a tree holding ~1M cached tokens in many branches (prompts of ~1k tokens that share system
prompts and parts of earlier prompts, plus a few 4k-token ones), then times the operations the scheduler
calls per request on 4k-token prompts, and measures the tree's host memory per cached token. Also times
the per-decode-step query of shared-prefix groups over a batch of 256 chats (16 conversations of 40
turns, 16 continuations each: 41 nodes on every request's path).
Goals: each op < 1 ms (median), < 64 bytes per cached token.

    python3 bench/radix_bench.py [--tokens 1000000] [--page-size 1] [--reps 200]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.cache.allocator import SlotAllocator  # noqa: E402
from shared.cache.radix_cache import RadixCache  # noqa: E402

VOCAB = 32000
LONG = 4096


def make_prompts(rng: np.random.Generator, target_tokens: int, page_size: int) -> list[np.ndarray]:
    """~1k-token prompts: one of 64 system prompts, often part of an earlier prompt, then fresh text.
    Enough of them that their union is about target_tokens; every 20th is a 4k-token one."""
    systems = [rng.integers(0, VOCAB, int(rng.integers(64, 512)), dtype=np.int32) for _ in range(64)]
    prompts: list[np.ndarray] = []
    unique = 0
    while unique < target_tokens:
        head = systems[int(rng.integers(len(systems)))]
        if prompts and rng.random() < 0.5:  # a follow-up turn or few-shot variant of an earlier prompt
            prev = prompts[int(rng.integers(len(prompts)))]
            head = prev[:int(rng.integers(len(prev) // 4, len(prev)))]
        length = LONG if len(prompts) % 20 == 19 else int(rng.integers(900, 1300))
        length = max(length, len(head) + 64)
        fresh = rng.integers(0, VOCAB, length - len(head), dtype=np.int32)
        p = np.concatenate([head, fresh])
        prompts.append(p[:len(p) - len(p) % page_size])
        unique += len(fresh)
    return prompts


def insert_prompt(cache: RadixCache, alloc: SlotAllocator, key) -> float:
    """Insert as the scheduler does on finish; returns the seconds spent in insert() alone."""
    slots = alloc.alloc(len(key))
    if slots is None:
        cache.evict(len(key))
        slots = alloc.alloc(len(key))
    t0 = time.perf_counter()
    done = cache.insert(key, slots)
    dt = time.perf_counter() - t0
    alloc.free(slots[:done])
    return dt


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="cached tokens to build the tree to")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    ps = args.page_size
    rng = np.random.default_rng(0)

    prompts = make_prompts(rng, args.tokens, ps)
    # Keys are handed over as Python lists: that is what the scheduler holds (req.all_ids).
    prompt_lists = [p.tolist() for p in prompts]
    extra = 4 * LONG * args.reps  # room for the insert/evict rounds beyond the built tree
    alloc = SlotAllocator(-(-(args.tokens + 2 * extra) // ps), ps, "cpu")
    cache = RadixCache(alloc, ps)

    # ---- build under tracemalloc: the allocator and the prompts exist before tracing starts --------
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    for key in prompt_lists:
        insert_prompt(cache, alloc, key)
    build_s = time.perf_counter() - t0
    gc.collect()
    tree_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = cache.stats()
    cached = st["cached_tokens"]
    print(f"built: {len(prompts)} prompts, {cached:,} cached tokens, {st['nodes']:,} nodes, "
          f"{build_s:.2f} s ({build_s / len(prompts) * 1e3:.2f} ms/insert incl. tracemalloc)")

    # ---- match: 4k prompts fully cached, and 4k prompts whose first ~1k is cached -----------------
    long_keys = [k for k in prompt_lists if len(k) == LONG - LONG % ps]
    short_keys = [k for k in prompt_lists if len(k) < LONG // 2]
    partial = [k + rng.integers(0, VOCAB, LONG - len(k), dtype=np.int32).tolist()
               for k in short_keys[:64]]
    for q in long_keys + partial:  # first match may split an edge; time the steady state
        cache.match_prefix(q)
    full_t, part_t = [], []
    for i in range(args.reps):
        q = long_keys[i % len(long_keys)]
        t0 = time.perf_counter()
        r = cache.match_prefix(q)
        full_t.append(time.perf_counter() - t0)
        assert r.length == len(q)
        q = partial[i % len(partial)]
        t0 = time.perf_counter()
        r = cache.match_prefix(q)
        part_t.append(time.perf_counter() - t0)
        assert 0 < r.length < LONG

    # ---- insert 4k (shares a prefix of a cached prompt), then evict 4k LRU tokens ---------------
    ins_t, ev_t, ev_freed = [], [], []
    for _ in range(args.reps):
        prev = prompts[int(rng.integers(len(prompts)))]
        head = prev[:int(rng.integers(0, len(prev)))]
        key = np.concatenate([head, rng.integers(0, VOCAB, LONG - len(head), dtype=np.int32)])
        key = key[:len(key) - len(key) % ps].tolist()
        ins_t.append(insert_prompt(cache, alloc, key))
        t0 = time.perf_counter()
        ev_freed.append(cache.evict(LONG))
        ev_t.append(time.perf_counter() - t0)
    assert min(ev_freed) >= LONG

    # ---- shared-prefix groups of a decode batch: 256 chats, 16 histories of 40 turns ------------
    chats = []
    for c in range(16):
        hist = rng.integers(0, VOCAB, 64, dtype=np.int32).tolist()
        for _ in range(40):
            hist = hist + rng.integers(0, VOCAB, 64, dtype=np.int32).tolist()
            insert_prompt(cache, alloc, hist[:len(hist) - len(hist) % ps])
        for b in range(16):
            key = hist + rng.integers(0, VOCAB, 16, dtype=np.int32).tolist()
            key = key[:len(key) - len(key) % ps]
            insert_prompt(cache, alloc, key)
            chats.append(cache.match_prefix(key).node)
    grp_t = []
    for _ in range(max(10, args.reps // 10)):
        t0 = time.perf_counter()
        groups = cache.shared_prefix_groups(chats)
        grp_t.append(time.perf_counter() - t0)
    assert len(groups) == 16 and all(len(m) == 16 for _, m in groups)

    per_token = tree_bytes / cached
    rows = [
        ("match_prefix 4k, full hit", f"{median_us(full_t):.0f} us", f"p90 {np.percentile(full_t, 90) * 1e6:.0f} us"),
        ("match_prefix 4k, ~1k hit", f"{median_us(part_t):.0f} us", f"p90 {np.percentile(part_t, 90) * 1e6:.0f} us"),
        ("insert 4k", f"{median_us(ins_t):.0f} us", f"p90 {np.percentile(ins_t, 90) * 1e6:.0f} us"),
        ("evict 4k", f"{median_us(ev_t):.0f} us",
         f"p90 {np.percentile(ev_t, 90) * 1e6:.0f} us, {statistics.mean(ev_freed):.0f} tok/call"),
        ("shared-prefix groups, 256 chats", f"{median_us(grp_t):.0f} us", "41 nodes on each request's path"),
        ("host memory / cached token", f"{per_token:.1f} B", f"{tree_bytes / 2**20:.1f} MiB total"),
    ]
    ok = max(median_us(full_t), median_us(part_t), median_us(ins_t), median_us(ev_t), median_us(grp_t)) < 1000 \
        and per_token < 64
    print(f"\nradix cache, page_size={ps}, {cached:,} cached tokens, {st['nodes']:,} nodes, "
          f"median of {args.reps}; goals: < 1000 us/op, < 64 B/token -> {'OK' if ok else 'MISSED'}")
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{w}}  {value:>9}   {note}")


if __name__ == "__main__":
    main()
