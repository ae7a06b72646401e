"""Engine sizes derived from memory: how many requests run together, the largest decode batch captured as a
CUDA graph, and the prompt tokens one request computes a pass, when the command line leaves them unset.

A fixed 256 running requests and graphs up to 256 left an 80 GB card's KV pool (~400k tokens of an 8B Llama)
mostly idle on workloads with more concurrent requests than that: the 64 x 16 shared-prefix workload reached
its radix-cache speed-up only with 1,024 of each (docs/design.md, "Engine sizes follow memory"). The rule:

- running requests: one per TOKENS_PER_RUNNING tokens of the KV pool, never fewer than the old fixed 256 nor
  more than MAX_RUNNING, nor more than a request-to-slot table of TABLE_BUDGET bytes holds at the context length;
- decode graphs: up to the running requests, at most the GPU tier's graph ceiling (the batch a graph is worth
  capturing for: launch overhead matters at every batch size, memory for graphs scales with it);
- prefill chunk: the GPU tier's, and at most a quarter of the pool (a chunk's KV must fit beside the running
  requests').

Without a GPU (CPU runs, tests) the sizes are the fixed ones this replaced. An explicit value always wins.
`reserve_bytes` estimates what these sizes take outside the KV pool, which the runner keeps free before it
sizes the pool, together with `transfer_budget_bytes` (PD: KV buffers between the workers). `tiered_cache` sizes
and builds the host KV tier under --enable-hierarchical-cache.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.cache.allocator import SlotAllocator
    from shared.cache.hiradix_cache import HiRadixCache
    from shared.engine.config import EngineConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
TOKENS_PER_RUNNING = 256  # pool tokens a running request is assumed to hold
MIN_RUNNING = 256  # the fixed default this derivation replaced: a small pool keeps it
MAX_RUNNING = 4096
TABLE_BUDGET = GIB  # the request-to-slot table: (running + 1) x context length x int32
MIN_CHUNK = 1024
# (smallest total GPU memory, decode-graph ceiling, prefill chunk), largest first. Cards from 60 GB (A100-80GB,
# H100, H200, B200) capture up to 1,024: the shared-prefix workload's concurrency, a few hundred MB of graph
# memory on an 8B Llama. Smaller cards keep the sizes that were the fixed defaults.
GPU_TIERS = ((60 * GIB, 1024, 8192), (0, 256, 4096))
# PD: the default bound on a worker's KV buffers in flight (--kv-transfer-max-bytes), in prefill chunks' KV. A
# prompt is charged from its admission: the pass computing, the one scheduled behind it (overlap) and the pages of
# the one before still on the wire, and one of slack for a slow ack; fewer and the prefill worker would wait for
# acks with its GPU idle. 4 GiB for an 8B Llama at 8,192-token chunks.
TRANSFER_CHUNKS = 4
CPU_SIZES = (256, 256, 4096)  # (running, graph ceiling, chunk) without a GPU: the fixed defaults, unchanged


@dataclass(frozen=True)
class Sizes:
    max_running_requests: int
    cuda_graph_max_bs: int
    chunked_prefill_size: int


@dataclass(frozen=True)
class ModelShape:
    """What the sizes cost outside the KV pool depends on: the context (request table), the vocabulary (the
    graphs' logits) and the widths (activations); act_bytes: the model dtype's element size."""
    context_len: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    act_bytes: int = 2


FIELDS = tuple(f.name for f in dataclasses.fields(Sizes))


def sizes_of(config) -> Sizes:
    """The three sizes of a filled config."""
    return Sizes(*(getattr(config, f) for f in FIELDS))


def derive_sizes(pool_tokens: int, gpu_bytes: int | None, shape: ModelShape) -> Sizes:
    """The derived sizes for a KV pool of pool_tokens on a GPU of gpu_bytes total memory (None: no GPU)."""
    if gpu_bytes is None:
        return Sizes(*CPU_SIZES)
    graph_cap, chunk = next((cap, c) for floor, cap, c in GPU_TIERS if gpu_bytes >= floor)
    by_table = TABLE_BUDGET // (4 * max(1, shape.context_len)) - 1
    running = max(MIN_RUNNING, min(pool_tokens // TOKENS_PER_RUNNING, MAX_RUNNING, by_table))
    return Sizes(running, min(graph_cap, running), min(chunk, max(MIN_CHUNK, pool_tokens // 4 // 256 * 256)))


def fill(config, sizes: Sizes):
    """config with each of the three sizes it leaves unset (None) taken from sizes; the graphs never exceed the
    running requests (as an explicit --max-running-requests below the graph ceiling asks)."""
    given = {f: getattr(config, f) for f in FIELDS}
    filled = {f: sizes.__dict__[f] if v is None else v for f, v in given.items()}
    if given["cuda_graph_max_bs"] is None:
        filled["cuda_graph_max_bs"] = min(filled["cuda_graph_max_bs"], filled["max_running_requests"])
    return dataclasses.replace(config, **filled)


def reserve_bytes(sizes: Sizes, shape: ModelShape) -> int:
    """An estimate of the device memory these sizes take besides the weights and the KV pool: the request table,
    the decode graphs' logits buffer and activations at their largest batch (sampling widens logits to fp32),
    a prefill chunk's activations, and a flat GiB for the allocator's slack, cuBLAS workspaces and the sampler."""
    s, a = shape, shape.act_bytes
    table = (sizes.max_running_requests + 1) * s.context_len * 4
    per_row = s.vocab_size * (a + 8) + (8 * s.hidden_size + 3 * s.intermediate_size) * a
    per_token = (6 * s.hidden_size + 3 * s.intermediate_size) * a
    return table + sizes.cuda_graph_max_bs * per_row + sizes.chunked_prefill_size * per_token + GIB


def transfer_budget_bytes(config, token_bytes: int) -> int:
    """PD: the bytes of KV buffers a worker's transfers may hold at once (0: no bound): --kv-transfer-max-bytes,
    or TRANSFER_CHUNKS prefill chunks of `token_bytes` (one token's KV as it travels) for a filled config."""
    if config.kv_transfer_max_bytes is not None:
        return max(0, config.kv_transfer_max_bytes)
    return TRANSFER_CHUNKS * (config.chunked_prefill_size or CPU_SIZES[2]) * token_bytes


def tiered_cache(config: "EngineConfig", allocator: "SlotAllocator", runner) -> "HiRadixCache":
    """The engine's cache under --enable-hierarchical-cache: the host pool (every tensor-parallel rank's, of its KV
    heads: runner.host_kv_pool) sized by the flags, per rank as SGLang's, and the host's memory shared by the ranks."""
    from shared.cache.hiradix_cache import HiRadixCache
    from shared.cache.host_pool import HostKVPool, HostTierError, available_host_bytes, host_pool_tokens
    from shared.engine.config import hicache_config_error

    error = hicache_config_error(config)
    if error:
        raise HostTierError(error)
    bytes_per_token = HostKVPool.token_bytes(runner.kv_pool)
    tokens = host_pool_tokens(allocator.total_size(), bytes_per_token, config.hicache_ratio, config.hicache_size,
                              available_host_bytes(), config.tp_size)
    host = runner.host_kv_pool(tokens)
    log.info("host KV tier: %d tokens (%.2f GiB%s, %s), device pool %d tokens", host.size_tokens(),
             tokens * bytes_per_token / 2**30, f" on each of {config.tp_size} ranks" if config.tp_size > 1 else "",
             config.hicache_write_policy, allocator.total_size())
    return HiRadixCache(allocator, config.page_size, host, config.hicache_write_policy, config.hicache_load_timeout)
