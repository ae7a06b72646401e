"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2: an FP8 KV pool through the real engine and loader on the CPU path (the
Triton kernels over FP8 pools are tested against their references in tests/kernels/: store_kv_fp8,
attention_fp8_pool, backend_end_to_end)."""
from __future__ import annotations

import os

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from kernels.reference import to_pool_ref
from shared.cache.kv_pool import KVPool, kv_cache_dtype
from shared.engine.config import EngineConfig
from shared.models.forward_batch import ForwardMode
from shared.engine.model_runner import ModelRunner
from shared.models.quantization import UnsupportedQuantization
from tests.support.hf_models import PagedHarness, make_hf_model, write_hf_checkpoint
from tests.support.engine_harness import Harness

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def test_kv_cache_dtype_names_and_bytes():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn  # vLLM's name
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="int8"):
        kv_cache_dtype("int8", torch.bfloat16)
    assert KVPool.bytes_per_token(32, 8, 128, torch.float8_e4m3fn) * 2 == KVPool.bytes_per_token(32, 8, 128,
                                                                                                 torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 pool only"):
        KVPool(2, 2, 16, 4, 1, torch.float32, "cpu", scales=[(0.5, 1.0), (1.0, 1.0)])


def test_cli_takes_sglang_and_vllm_names_and_refuses_others():
    import argparse

    from shared.engine.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name in ("auto", "fp8_e4m3", "fp8_e5m2", "fp8"):
        assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", name])).kv_cache_dtype == name
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def _paged(model, cfg, pool_dtype, scales=None) -> PagedHarness:
    h = PagedHarness(model, cfg)
    h.kv = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_pages=h.max_tokens, page_size=1,
                  dtype=pool_dtype, device="cpu", scales=scales)
    return h


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_holds_the_rounded_kv_and_decodes_close_to_full_precision(pool_dtype):
    """A prompt's pass reads its own k, v unrounded (logits equal the fp32 pool's bit for bit), the pool holds
    exactly the fp32 pool's rows rounded (with each layer's scales), and decode steps that read them stay close to
    full precision without being equal to it."""
    from shared.models.loader import load_model

    model, cfg = load_model("tiny-random", dtype=torch.float32)
    scales = [(0.05 * (i + 1), 0.08 * (i + 1)) for i in range(cfg.num_hidden_layers)]
    full, fp8 = _paged(model, cfg, torch.float32), _paged(model, cfg, pool_dtype, scales)
    prompt = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = full.step(ForwardMode.EXTEND, {0: prompt})[0], fp8.step(ForwardMode.EXTEND, {0: prompt})[0]
    assert torch.equal(a, b)
    slots = torch.arange(1, 1 + len(prompt))
    for layer, (ks, vs) in enumerate(scales):
        assert torch.equal(fp8.kv.k_buffers[layer][slots].float(),
                           to_pool_ref(full.kv.k_buffers[layer][slots], ks, pool_dtype).float())
        assert torch.equal(fp8.kv.v_buffers[layer][slots].float(),
                           to_pool_ref(full.kv.v_buffers[layer][slots], vs, pool_dtype).float())
    token = int(a[-1].argmax())
    for _ in range(4):
        a = full.step(ForwardMode.DECODE, {0: [token]})[0][-1]
        b = fp8.step(ForwardMode.DECODE, {0: [token]})[0][-1]
        assert not torch.equal(a, b)  # the rounded prefix is read
        err = float((a - b).abs().max() / a.abs().max())
        assert err < (0.05 if pool_dtype == torch.float8_e4m3fn else 0.1), err
        token = int(a.argmax())


def test_engine_with_an_fp8_kv_cache_serves_and_frees_every_slot():
    """The real engine (radix cache, chunked prefill, retraction machinery) on an FP8 pool: every request
    finishes, its first token (its prompt's pass reads unrounded k, v) is the fp32 pool's, a repeated prompt hits
    the cache, and every slot is free after."""
    fp8 = Harness(kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16, max_prefill_tokens=64)
    full = Harness()
    assert fp8.engine.runner.kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn
    assert fp8.engine.info()["kv_cache_dtype"] == "float8_e4m3fn" and full.engine.info()["kv_cache_dtype"] == "float32"
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(6)]
    got = fp8.run([fp8.submit(p, sampling=GREEDY) for p in prompts])
    want = full.run([full.submit(p, sampling=GREEDY) for p in prompts])
    assert all(len(r["ids"]) == 16 and r["error"] is None for r in got)
    assert [r["ids"][0] for r in got] == [r["ids"][0] for r in want]
    again = fp8.generate(prompts[0], sampling=GREEDY)
    assert again["cached"] >= len(prompts[0]) - 1
    fp8.engine.cache.evict(10 ** 9)
    assert fp8.free_tokens() == fp8.engine.runner.max_total_tokens


def test_fp8_kv_cache_with_fp8_weights():
    """FP8 weights (--quantization fp8) and an FP8 KV cache together, the usual Hopper deployment: served, with the
    first token of the FP8-weight engine with a float32 pool."""
    both = Harness(quantization="fp8", kv_cache_dtype="fp8_e5m2")
    weights_only = Harness(quantization="fp8")
    assert both.engine.runner.kv_pool.k_buffers[0].dtype == torch.float8_e5m2
    prompts = [list(range(11 + i, 50 + i)) for i in range(3)]
    got = both.run([both.submit(p, sampling=GREEDY) for p in prompts])
    want = weights_only.run([weights_only.submit(p, sampling=GREEDY) for p in prompts])
    assert all(len(r["ids"]) == 16 and r["error"] is None for r in got)
    assert [r["ids"][0] for r in got] == [r["ids"][0] for r in want]


@pytest.mark.gpu  # the rope epilogue is the GPU's
def test_fp8_kv_cache_keeps_the_rope_epilogue_at_unit_scales():
    """An FP8 pool without checkpoint scales keeps the qkv GEMV's rope + KV-store epilogue (it converts as the rope
    kernel does) and decodes the tokens of the engine without it."""
    fused = Harness(kv_cache_dtype="fp8_e4m3", dtype="bfloat16")
    plain = Harness(kv_cache_dtype="fp8_e4m3", dtype="bfloat16", decode_rope_fusion=False)
    assert fused.engine.runner.decode_rope_fusion and not plain.engine.runner.decode_rope_fusion
    prompts = [list(range(11 + i, 50 + i)) for i in range(3)]
    assert [r["ids"] for r in fused.run([fused.submit(p, sampling=GREEDY) for p in prompts])] == \
        [r["ids"] for r in plain.run([plain.submit(p, sampling=GREEDY) for p in prompts])]


def _checkpoint_with_kv_scales(tmp_path, names: dict[int, tuple[str, float, str, float]]) -> str:
    hf = make_hf_model("llama31")
    path = write_hf_checkpoint(hf, str(tmp_path / "ckpt"))
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    for layer, (k_name, k, v_name, v) in names.items():
        tensors[f"model.layers.{layer}.self_attn.{k_name}"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.{v_name}"] = torch.tensor(v)
    save_file(tensors, f)
    return path


def _runner(path: str, kv: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=path, kv_cache_dtype=kv, dtype="float32", max_total_tokens=512,
                                    max_running_requests=4))


@pytest.mark.parametrize("k_name,v_name", [("k_scale", "v_scale"), ("kv_scale", "kv_scale"),
                                           ("k_proj.output_scale", "v_proj.output_scale")])
def test_checkpoint_kv_scales_scale_an_fp8_pool_and_nothing_else(tmp_path, k_name, v_name):
    path = _checkpoint_with_kv_scales(tmp_path, {0: (k_name, 0.25, v_name, 0.5), 1: (k_name, 2.0, v_name, 4.0)})
    fp8 = _runner(path, "fp8_e4m3")
    want = [(0.25, 0.5), (2.0, 4.0)] if k_name != "kv_scale" else [(0.5, 0.5), (4.0, 4.0)]
    assert fp8.kv_pool.scales == want
    assert not fp8.decode_rope_fusion  # the qkv GEMV's rope epilogue writes FP8 at unit scales only
    # A bf16/fp32 pool needs no scales: the checkpoint loads as before, unscaled.
    assert _runner(path, "auto").kv_pool.scales == [(1.0, 1.0)] * 2


def test_checkpoint_kv_scales_for_some_layers_only_or_not_positive_are_refused(tmp_path):
    path = _checkpoint_with_kv_scales(tmp_path, {0: ("k_scale", 0.25, "v_scale", 0.5)})
    with pytest.raises(UnsupportedQuantization, match="not for layers \\[1\\]"):
        _runner(path, "fp8_e4m3")
    path = _checkpoint_with_kv_scales(tmp_path, {0: ("k_scale", 0.25, "v_scale", 0.5),
                                                 1: ("k_scale", 0.0, "v_scale", 0.5)})
    with pytest.raises(UnsupportedQuantization, match="positive"):
        _runner(path, "fp8_e4m3")


def _pd(prefill_kv: str, decode_kv: str):
    """A prefill and a decode worker process (each with its own --kv-cache-dtype) behind a gateway."""
    from tests.pd.test_pd import start_pd_processes

    *procs, url = start_pd_processes(("--kv-cache-dtype", prefill_kv), ("--kv-cache-dtype", decode_kv))
    return procs, url


@pytest.mark.e2e
def test_pd_moves_fp8_pages_and_decodes_what_a_unified_fp8_engine_decodes():
    """KV pages of an FP8 pool cross between the PD workers over UCX as FP8 bytes, one a value: the decode
    worker's output equals a unified FP8 engine's, the decode side counts the transfer's bytes, and nothing is
    held after."""
    from tests.pd.test_pd import assert_no_kv_held, worker_infos
    from tests.support.stack import kill_groups

    procs, url = _pd("fp8_e4m3", "fp8_e4m3")
    try:
        infos = worker_infos(url)
        assert {r: i["kv_cache_dtype"] for r, i in infos.items()} == {"prefill": "float8_e4m3fn",
                                                                    "decode": "float8_e4m3fn"}
        unified = Harness(kv_cache_dtype="fp8_e4m3")
        ids = [list(range(7 + i, 60 + 5 * i)) for i in range(3)]
        for prompt in ids:
            r = requests.post(url + "/generate", json={"input_ids": prompt, "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == unified.generate(prompt, sampling=GREEDY)["ids"]
        received = worker_infos(url)["decode"]["kv_transfer"]
        assert received["received_tokens"] >= sum(len(p) for p in ids) - 3
        # One FP8 byte an element: layers x (k, v) x kv heads x head dim bytes a token.
        cfg = unified.engine.runner.model_config
        per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
        assert received["received_bytes"] == received["received_tokens"] * per_token
        assert_no_kv_held(url)
    finally:
        kill_groups(*procs)


@pytest.mark.e2e
def test_pd_pools_of_different_kv_dtypes_are_not_paired():
    """A prefill worker with an FP8 pool and a decode worker with a float32 one: the gateway never pairs them (their
    formats differ in the pong), so the decode worker computes each request whole; no request fails and no page
    is pushed to be refused."""
    from tests.pd.test_pd import assert_no_kv_held, worker_infos
    from tests.support.stack import kill_groups

    procs, url = _pd("fp8_e4m3", "auto")
    try:
        unified = Harness()
        prompt = list(range(9, 70))
        r = requests.post(url + "/generate", json={"input_ids": prompt, "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == unified.generate(prompt, sampling=GREEDY)["ids"]
        infos = worker_infos(url)
        assert infos["decode"]["kv_transfer"]["received_tokens"] == 0 and infos["decode"]["kv_transfer"]["refused"] == 0
        assert infos["prefill"]["kv_transfer"]["transfers"] == 0
        assert_no_kv_held(url)
    finally:
        kill_groups(*procs)
