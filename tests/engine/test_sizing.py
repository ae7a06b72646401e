"""Engine sizes derived from memory (shared/engine/sizing.py): the rule's cases, explicit values winning, the flags."""
from __future__ import annotations

import argparse

import pytest

from shared.engine.cli import add_engine_args, engine_args_to_argv, engine_config_from_args
from shared.engine.config import EngineConfig
from shared.engine.sizing import (GIB, TRANSFER_CHUNKS, ModelShape, Sizes, derive_sizes, fill, reserve_bytes,
                                  transfer_budget_bytes)

LLAMA_8B = ModelShape(context_len=8192, vocab_size=128256, hidden_size=4096, intermediate_size=14336)
H100, H200 = 80 * GIB, 141 * GIB
H100_POOL = 424_000  # an 8B Llama's bf16 KV pool at --mem-fraction-static 0.85 on an H100


def test_an_h100_runs_the_shared_prefix_workload_at_once():
    """1,024 requests (64 x 16) decode together and in graphs: the issue's shared-prefix speed-up without flags."""
    s = derive_sizes(H100_POOL, H100, LLAMA_8B)
    assert s.max_running_requests >= 1024 and s.cuda_graph_max_bs == 1024 and s.chunked_prefill_size == 8192
    h200 = derive_sizes(2 * H100_POOL, H200, LLAMA_8B)
    assert h200.max_running_requests > s.max_running_requests and h200.cuda_graph_max_bs == 1024


@pytest.mark.parametrize("pool,gpu,shape,want", [
    # No GPU: the fixed sizes of before, whatever the pool.
    (65536, None, LLAMA_8B, Sizes(256, 256, 4096)),
    (10 ** 7, None, LLAMA_8B, Sizes(256, 256, 4096)),
    # A small pool on a large card keeps 256 running (never fewer than the old default); its chunk is a quarter of it.
    (20_000, H100, LLAMA_8B, Sizes(256, 256, 4864)),
    (2_000, H100, LLAMA_8B, Sizes(256, 256, 1024)),
    # A 24 GB card: graphs and chunk of the lower tier.
    (150_000, 24 * GIB, LLAMA_8B, Sizes(585, 256, 4096)),
    # Llama-3.1's 128k context: the request table (running x context x 4 bytes) stays within a GiB.
    (H100_POOL, H100, ModelShape(131072, 128256, 4096, 14336), Sizes(1656, 1024, 8192)),
    (4 * H100_POOL, H200, ModelShape(131072, 128256, 4096, 14336), Sizes(2047, 1024, 8192)),
    # A huge pool: at most 4,096 running.
    (10 ** 7, H200, LLAMA_8B, Sizes(4096, 1024, 8192)),
])
def test_derived_sizes(pool, gpu, shape, want):
    assert derive_sizes(pool, gpu, shape) == want


def test_sizes_never_shrink_as_the_pool_or_the_card_grows():
    """The runner sizes its pool after reserving memory for the sizes a provisional, larger pool implies: that is
    only safe if a smaller pool never derives larger sizes."""
    prev = None
    for pool in range(1000, 2_000_000, 7919):
        s = derive_sizes(pool, H100, LLAMA_8B)
        if prev:
            assert all(a >= b for a, b in zip(s.__dict__.values(), prev.__dict__.values())), (pool, s, prev)
        prev = s
    small, big = derive_sizes(H100_POOL, 40 * GIB, LLAMA_8B), derive_sizes(H100_POOL, H100, LLAMA_8B)
    assert all(a <= b for a, b in zip(small.__dict__.values(), big.__dict__.values()))


def test_reserve_fits_the_h100_margin_and_grows_with_the_graphs():
    """At the derived sizes the estimate stays under the 15% an H100 keeps back by default, so the pool is the same
    size as before; more graphs or a longer context reserve more."""
    long_ctx = ModelShape(131072, 128256, 4096, 14336)
    s = derive_sizes(H100_POOL, H100, long_ctx)
    assert reserve_bytes(s, long_ctx) < 0.15 * H100
    assert reserve_bytes(Sizes(256, 1024, 8192), LLAMA_8B) > reserve_bytes(Sizes(256, 256, 8192), LLAMA_8B)
    assert reserve_bytes(s, long_ctx) > reserve_bytes(s, LLAMA_8B)


def test_explicit_values_win():
    derived = Sizes(1656, 1024, 8192)
    assert fill(EngineConfig(), derived).__dict__.items() >= {"max_running_requests": 1656, "cuda_graph_max_bs": 1024,
                                                              "chunked_prefill_size": 8192}.items()
    # Fewer running requests than the graph ceiling: the derived graphs stop at them.
    c = fill(EngineConfig(max_running_requests=64), derived)
    assert (c.max_running_requests, c.cuda_graph_max_bs, c.chunked_prefill_size) == (64, 64, 8192)
    c = fill(EngineConfig(cuda_graph_max_bs=512, chunked_prefill_size=2048), derived)
    assert (c.max_running_requests, c.cuda_graph_max_bs, c.chunked_prefill_size) == (1656, 512, 2048)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_flags_unset_are_derived_and_given_ones_reach_the_workers():
    args = _parse([])
    assert engine_config_from_args(args).max_running_requests is None and engine_args_to_argv(args) == []
    args = _parse(["--max-running-requests", "1024", "--cuda-graph-max-bs", "1024", "--chunked-prefill-size", "2048"])
    cfg = engine_config_from_args(args)
    assert (cfg.max_running_requests, cfg.cuda_graph_max_bs, cfg.chunked_prefill_size) == (1024, 1024, 2048)
    assert engine_args_to_argv(args) == ["--max-running-requests", "1024", "--chunked-prefill-size", "2048",
                                         "--cuda-graph-max-bs", "1024"]
    with pytest.raises(SystemExit):
        _parse(["--max-running-requests", "0"])


def test_a_cpu_engine_runs_with_the_fixed_sizes_unless_told():
    from tests.support.engine_harness import Harness

    h = Harness(max_total_tokens=4096)
    info = h.engine.info()
    assert (info["max_running_requests"], info["chunked_prefill_size"], info["cuda_graphs"]) == (256, 4096, None)
    assert h.engine.runner.req_pool.max_reqs == 256
    h = Harness(max_total_tokens=4096, max_running_requests=8)
    assert h.engine.config.max_running_requests == 8 and h.engine.runner.config.max_running_requests == 8


@pytest.mark.gpu
def test_a_gpu_engine_derives_its_sizes_and_reports_its_graphs():
    """On a GPU with the pool left to free memory: the sizes are derive_sizes' for that pool and card (the tiny model's
    pool is large: more than 256 running requests), the decode graphs reach them, and the capture's time and memory
    are reported; an explicit value still wins there."""
    import torch

    from shared.engine.sizing import derive_sizes
    from tests.support.engine_harness import Harness

    # The tiny model's pool from free memory, leaving 85% of the card to whatever else the GPU run holds.
    h = Harness(max_total_tokens=None, mem_fraction_static=0.15, max_context_len=2048)
    r, info = h.engine.runner, h.engine.info()
    want = derive_sizes(r.max_total_tokens, torch.cuda.mem_get_info()[1], r.shape())
    assert (info["max_running_requests"], info["chunked_prefill_size"]) == (want.max_running_requests,
                                                                          want.chunked_prefill_size)
    assert want.max_running_requests > 256 and r.req_pool.max_reqs == want.max_running_requests
    g = info["cuda_graphs"]
    assert g["decode_max_bs"] == want.cuda_graph_max_bs and g["decode_graphs"] > 0 and g["capture_s"] > 0, g
    assert g["memory_bytes"] > 0, g
    out = h.generate(list(range(5, 40)), sampling={"max_new_tokens": 4, "temperature": 0})
    assert len(out["ids"]) == 4
    h = Harness(max_context_len=2048, max_running_requests=16)
    assert h.engine.info()["cuda_graphs"]["decode_max_bs"] == 16 and h.engine.runner.req_pool.max_reqs == 16


def _pool_tokens_on(monkeypatch, free: int, total: int, context_len: int, fraction: float, **config) -> int:
    """ModelRunner._pool_tokens of an 8B Llama (bf16 KV) on a card reporting (free, total), without a GPU."""
    import functools
    import types

    import torch

    from shared.engine.model_runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    r = types.SimpleNamespace(
        config=EngineConfig(mem_fraction_static=fraction, **config), device=torch.device("cuda", 0), num_kv_heads=8,
        kv_dtype=torch.bfloat16, dtype=torch.bfloat16, max_context_len=context_len,
        model_config=types.SimpleNamespace(num_hidden_layers=32, head_dim=128, vocab_size=128256, hidden_size=4096,
                                           intermediate_size=14336, num_key_value_heads=8))
    r.shape = functools.partial(ModelRunner.shape, r)
    r.kv_layout = functools.partial(ModelRunner.kv_layout, r)
    r.kv_transfer_token_bytes = functools.partial(ModelRunner.kv_transfer_token_bytes, r)
    r.sized = functools.partial(ModelRunner.sized, r)
    tokens, gpu = ModelRunner._pool_tokens(r)
    assert gpu == total
    return tokens


def test_the_pool_keeps_room_for_the_sizes_it_implies(monkeypatch):
    """An H100 at the default fraction: the 15% margin covers the derived sizes' needs, so the pool is what it was
    before they were derived. With a thin margin and Llama-3.1's 128k context, the estimate is the larger and the
    pool gives way to it."""
    per_token = 32 * 2 * 8 * 128 * 2
    free = 64 * GIB
    assert _pool_tokens_on(monkeypatch, free, H100, 8192, 0.85) == int((free - 0.15 * H100) // per_token)
    thin = _pool_tokens_on(monkeypatch, free, H100, 131072, 0.95)
    assert thin < int((free - 0.05 * H100) // per_token)
    long_ctx = ModelShape(131072, 128256, 4096, 14336)
    provisional = derive_sizes(int((free - 0.05 * H100) // per_token), H100, long_ctx)
    transfers = TRANSFER_CHUNKS * provisional.chunked_prefill_size * per_token  # PD buffers in flight
    assert thin == int((free - reserve_bytes(provisional, long_ctx) - transfers) // per_token)


def test_the_pool_leaves_room_for_the_kv_transfer_budget(monkeypatch):
    """PD: the KV buffers of transfers in flight (--kv-transfer-max-bytes) live outside the pool; a budget beyond
    the 15% margin takes its bytes from the pool, 0 (no bound) reserves nothing."""
    per_token = 32 * 2 * 8 * 128 * 2
    free = 64 * GIB
    default = _pool_tokens_on(monkeypatch, free, H100, 8192, 0.85)
    assert _pool_tokens_on(monkeypatch, free, H100, 8192, 0.85, kv_transfer_max_bytes=0) == default
    big = _pool_tokens_on(monkeypatch, free, H100, 8192, 0.85, kv_transfer_max_bytes=20 * GIB)
    assert default - big > (20 * GIB - 0.15 * H100) // per_token
    assert transfer_budget_bytes(EngineConfig(chunked_prefill_size=8192), per_token) == 4 * GIB


def test_only_a_pd_worker_reserves_a_transfer_budget():
    """A unified worker moves no KV between workers: its pool leaves no room for the derived budget; a prefill or
    decode worker keeps the derived default, and an explicit value wins on any role."""
    from services.worker.__main__ import parse_args, worker_engine_config

    def budget(*argv):
        config = worker_engine_config(parse_args(["--model-path", "tiny-random", *argv]))
        return config.kv_transfer_max_bytes

    assert budget() == 0
    assert budget("--role", "prefill") is None and budget("--role", "decode") is None
    assert budget("--kv-transfer-max-bytes", "1000") == 1000


def test_the_pool_leaves_room_for_a_standalone_draft(monkeypatch):
    """STANDALONE's draft runner is built after the target's pool, with a pool of as many tokens: the target's pool
    gives way to the draft's KV a token and its weights and sizes, beside the target's own 15% margin."""
    import types

    from shared.engine.spec.draft import draft_config, draft_memory

    free = 64 * GIB
    per_token = 32 * 2 * 8 * 128 * 2
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "tiny-random"}
    tokens = _pool_tokens_on(monkeypatch, free, H100, 8192, 0.85, **spec)
    filled = fill(EngineConfig(**spec), derive_sizes(int((free - 0.15 * H100) // per_token), H100, LLAMA_8B))
    sizes = Sizes(filled.max_running_requests, filled.cuda_graph_max_bs, filled.chunked_prefill_size)
    draft_per_token, draft_rest = draft_memory(filled, sizes, 8192, 2)
    assert draft_per_token == 2 * 2 * 2 * 16 * 2 and draft_rest > GIB
    assert tokens == int((free - 0.15 * H100 - draft_rest) // (per_token + draft_per_token))
    # The draft captures decode graphs only up to the batch that still drafts.
    assert draft_config(filled, types.SimpleNamespace(max_total_tokens=tokens, max_context_len=8192)) \
        .cuda_graph_max_bs == filled.speculative_disable_batch_size == 64


def test_the_draft_memory_estimate_is_the_built_draft_runners():
    """draft_memory's KV bytes a token and weight bytes are those of the draft runner draft_config builds."""
    import types

    import torch

    from shared.engine.model_runner import ModelRunner
    from shared.engine.spec.draft import draft_config, draft_memory

    cfg = EngineConfig(model_path="tiny-random", device="cpu", speculative_algorithm="STANDALONE",
                       speculative_draft_model_path="tiny-random", max_running_requests=8, cuda_graph_max_bs=8,
                       chunked_prefill_size=256)
    sizes = Sizes(8, 8, 256)
    draft_per_token, draft_rest = draft_memory(cfg, sizes, 256, 4)
    r = ModelRunner(draft_config(cfg, types.SimpleNamespace(max_total_tokens=2048, max_context_len=256)))
    assert draft_per_token == r.kv_pool.bytes_per_token(r.model_config.num_hidden_layers, r.num_kv_heads,
                                                        r.model_config.head_dim, r.kv_dtype)
    weights = sum(p.numel() * p.element_size() for p in r.model.parameters())
    assert r.dtype == torch.float32 and draft_rest == weights + reserve_bytes(sizes, r.shape())
