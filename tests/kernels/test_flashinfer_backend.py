"""The flashinfer attention backend (shared/models/attention/flashinfer_backend.py).

On a CPU: the slot gather its page indices come from (a Triton kernel, interpreted), and the backend's planning
against a stand-in `flashinfer` module (tests/kernels/_flashinfer_standin.py) whose wrappers take flashinfer 0.7.4's
signatures and attend in plain torch over exactly the indices, offsets, lengths and page views they were planned
with: a pass's outputs must equal the torch backend's. The stand-in's recorded signatures are checked against the real
package where it imports (installed, or the repacked wheel in .whl/fi/, its kernels not needed). On a GPU (`-m gpu`,
with flashinfer installed): the real wrappers against the torch backend, eager and in a CUDA graph replayed over new
lengths, and the engine's greedy tokens against the Triton backend's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from tests.kernels import _flashinfer_standin as standin
from tests.kernels._helpers import _tol, write_rows
from tests.kernels._runner import kernel_tests

HQ, HKV, D, LAYERS = 8, 2, 128, 2  # FlashInfer's JIT builds a module per head dim: the benchmark's


def check_paged_kv_indices(device, dtype):
    """Each request's slots from its slot-table row, packed at its offset; the rest of the output untouched."""
    from kernels.attention.paged_kv_indices import paged_kv_indices, paged_kv_indices_ref
    gen = torch.Generator().manual_seed(0)
    r2t = torch.randint(1, 10_000, (6, 1500), generator=gen, dtype=torch.int32).to(device)
    rows = torch.tensor([3, 0, 5, 1], device=device)
    lens = torch.tensor([1, 0, 1500, 513], dtype=torch.int32, device=device)  # past one block, a whole row
    indptr = torch.tensor([0, 1, 1, 1501, 2014], dtype=torch.int32, device=device)
    out = torch.full((2100,), -1, dtype=torch.int32, device=device)
    paged_kv_indices(r2t, rows, lens, indptr, out)
    ref = paged_kv_indices_ref(r2t, rows, lens, indptr, torch.full_like(out, -1))
    assert torch.equal(out, ref)
    assert torch.equal(out[1:1501], r2t[5]) and bool((out[2014:] == -1).all())


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())


# ------------------------------------------------------------------ a stand-in flashinfer (CPU)
@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = standin.Decode
    mod.BatchPrefillWithPagedKVCacheWrapper = standin.Paged
    mod.BatchPrefillWithRaggedKVCacheWrapper = standin.Ragged
    mod.merge_state = standin.merge_state
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(standin._Wrapper, "plans", [])
    import shared.models.attention.flashinfer_backend as backend
    monkeypatch.setattr(backend, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(backend, "GRAPH_INT_WORKSPACE_BYTES", 1024)
    return mod


def _world(backend, device, dtype, pool_dtype, scales):
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    pool = KVPool(LAYERS, HKV, D, num_pages=200, page_size=1, dtype=pool_dtype or dtype, device=device, scales=scales)
    return backend, pool, ReqToTokenPool(8, 256, device)


def _passes(device="cpu", dtype=torch.bfloat16, pool_dtype=None, scales=None, graph_decode=False):
    """Four passes (prompts with no prefix: ragged; second chunks over the first and a new prompt: ragged + paged;
    two decode steps) through the torch backend and the flashinfer one on identical pools: their outputs, pass by
    pass."""
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    from shared.models.attention import TorchAttentionBackend
    from shared.models.attention.flashinfer_backend import FlashInferAttentionBackend
    worlds = [_world(TorchAttentionBackend(HQ, HKV, D), device, dtype, pool_dtype, scales),
              _world(FlashInferAttentionBackend(HQ, HKV, D, device=device, dtype=dtype), device, dtype, pool_dtype,
                     scales)]
    gen = torch.Generator().manual_seed(1)
    # The second pass: three requests over their cached prefixes and, among them, a new one with none (row 3); one
    # extends by more than 64 tokens, which on an H100 moves the paged prefill from FA2 to FA3 (flashinfer/prefill.py
    # _determine_auto_backend), the kernels that read a request's KV length from its last_page_len.
    steps = [(ForwardMode.EXTEND, [2, 5, 7], [0, 0, 0], [13, 4, 1]),
             (ForwardMode.EXTEND, [2, 3, 5, 7], [13, 0, 4, 1], [70, 5, 1, 9]),
             (ForwardMode.DECODE, [2, 3, 5, 7], [83, 5, 5, 10], [1, 1, 1, 1]),
             (ForwardMode.DECODE, [2, 3, 5, 7], [84, 6, 6, 11], [1, 1, 1, 1])]
    slot, results = 1, []
    for mode, rows, prefix, ext in steps:
        T = sum(ext)
        # Scattered slots, as a radix cache hands them out.
        locs = (torch.arange(slot, slot + T) * 7) % 199 + 1
        slot += T
        q, k, v = (torch.randn(T, h * D, generator=gen).to(device, dtype) for h in (HQ, HKV, HKV))
        outs = []
        for be, pool, r2t in worlds:
            write_rows(r2t, rows, prefix, ext, locs, device)
            fb = ForwardBatch.build(mode, [0] * T, rows, prefix, ext, locs, r2t.req_to_token, pool, be,
                                    torch.device(device))
            if graph_decode and mode == ForwardMode.DECODE and isinstance(be, FlashInferAttentionBackend):
                fb.seq_lens_cpu = None  # as the CUDA-graph runner builds its batches: device tensors only
            be.init_forward_metadata(fb)
            outs.append(torch.stack([be.forward(q, k, v, layer, fb) for layer in range(LAYERS)]))
        results.append(outs)
    return results


def test_plans_once_a_pass_and_attends_over_the_planned_slots(fake_flashinfer):
    for graph_decode in (False, True):
        standin._Wrapper.plans.clear()
        for ref, ours in _passes(graph_decode=graph_decode):
            torch.testing.assert_close(ours, ref, **_tol(torch.bfloat16))
        assert standin._Wrapper.plans == [("ragged", False), ("ragged", False), ("paged", False),
                                          ("decode", graph_decode), ("decode", graph_decode)]


def test_an_fp8_pool_reads_with_its_scales(fake_flashinfer):
    """The prefix and decode read the pool times each layer's scales; an extend's new tokens are read as computed
    (as the torch and Triton backends read them)."""
    for ref, ours in _passes(pool_dtype=torch.float8_e4m3fn, scales=[(0.5, 1.3), (1.0, 0.8)]):
        torch.testing.assert_close(ours, ref, **_tol(torch.bfloat16))


def test_indptr_of():
    from shared.models.attention.flashinfer_backend import indptr_of
    assert indptr_of([3, 0, 5]).tolist() == [0, 3, 3, 8] and indptr_of([]).tolist() == [0]
    assert indptr_of([1]).dtype == torch.int32


def test_factory_errors_name_the_device_head_dim_and_the_install_command():
    from shared.models.attention import create_attention_backend
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_attention_backend("flashinfer", HQ, HKV, D, device="cpu")
    with pytest.raises(ValueError, match="runs head dims 64, 128, 256; this model's is 16: use triton"):
        create_attention_backend("flashinfer", HQ, HKV, 16, device="cuda")
    with pytest.raises(ValueError, match="runs float16 and bfloat16 models; this one is float32: use triton"):
        create_attention_backend("flashinfer", HQ, HKV, D, device="cuda", dtype=torch.float32)
    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ValueError, match=r"needs the flashinfer-python package.*pip install.*triton"):
            create_attention_backend("flashinfer", HQ, HKV, D, device="cuda")


# The real package's signatures, annotations dropped, as JSON on stdout (flashinfer imports without a GPU).
_REAL_SIGNATURES = """
import inspect, json, flashinfer
def bare(f):
    s = inspect.signature(f)
    return str(s.replace(parameters=[p.replace(annotation=p.empty) for p in s.parameters.values()],
                         return_annotation=s.empty))
out = {"version": flashinfer.__version__}
for key in json.loads(input()):
    obj = flashinfer
    for part in key.split("."):
        obj = getattr(obj, part)
    out[key] = bare(obj)
print(json.dumps(out))
"""


def _real_flashinfer(tmp_path) -> str | None:
    """A PYTHONPATH under which the real flashinfer imports: "" where it is installed, else the Python files of the
    repacked wheel (bench/fetch_flashinfer.sh's .whl/fi/) unpacked under tmp_path; None: neither is here."""
    if importlib.util.find_spec("flashinfer") is not None:
        return ""
    wheels = sorted((Path(__file__).resolve().parents[2] / ".whl" / "fi").glob(
        f"flashinfer_python-{standin.VERSION}-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp_path, [n for n in z.namelist()
                                if n.startswith("flashinfer/") and n.endswith(".py") and "/data/" not in n])
    return str(tmp_path)


def test_the_standins_signatures_are_flashinfers(tmp_path):
    """Each signature the stand-in binds calls to is the pinned release's own, parameter for parameter (names, kinds,
    defaults): what makes the CPU tests' calls the GPU's."""
    from shared.engine.config import FLASHINFER_INSTALL
    assert f"flashinfer-python=={standin.VERSION}" in FLASHINFER_INSTALL  # the records are the pinned release's
    path = _real_flashinfer(tmp_path)
    if path is None:
        pytest.skip("flashinfer is neither installed nor in .whl/fi/ (bench/fetch_flashinfer.sh)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p))
    run = subprocess.run([sys.executable, "-c", _REAL_SIGNATURES], input=json.dumps(list(standin.SIGNATURES)),
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    if run.returncode != 0:
        pytest.skip(f"flashinfer does not import here: {run.stderr.strip().splitlines()[-1:]}")
    real = json.loads(run.stdout.strip().splitlines()[-1])
    assert real.pop("version") == standin.VERSION
    assert real == standin.SIGNATURES


# ------------------------------------------------------------------ on a GPU, the real wrappers
def _needs_flashinfer():
    """The optional extra: a GPU run without it skips these (bench/gpu_run.sh tests --flashinfer installs it, and
    stops before the tests if it does not import)."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (bench/fetch_flashinfer.sh, then bench/gpu_run.sh tests --flashinfer)")


@pytest.mark.gpu
@pytest.mark.parametrize("pool", [None, torch.float8_e4m3fn])  # FP8 KV: FA2 kernels that dequantize it (not FA3)
def test_flashinfer_passes_match_the_torch_backend_on_cuda(pool):
    _needs_flashinfer()
    scales = [(0.5, 1.3), (1.0, 0.8)] if pool is not None else None
    for graph_decode in (False, True):
        for ref, ours in _passes("cuda", torch.bfloat16, pool_dtype=pool, scales=scales, graph_decode=graph_decode):
            torch.testing.assert_close(ours, ref, **_tol(torch.bfloat16))


@pytest.mark.gpu
def test_flashinfer_decode_graph_replays_over_new_lengths():
    """A decode pass captured in a CUDA graph at one set of context lengths and replayed at longer ones (re-planned
    on the host before each replay, the indices gathered inside the graph) equals eager torch attention."""
    _needs_flashinfer()
    from shared.cache.kv_pool import KVPool, ReqToTokenPool
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    from shared.models.attention import TorchAttentionBackend
    from shared.models.attention.flashinfer_backend import FlashInferAttentionBackend
    dev, dt, bs = torch.device("cuda"), torch.bfloat16, 4
    be = FlashInferAttentionBackend(HQ, HKV, D, device=dev, dtype=dt)
    pool = KVPool(1, HKV, D, num_pages=4096, page_size=1, dtype=dt, device=dev)
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    r2t = ReqToTokenPool(8, 1024, dev)
    r2t.req_to_token[1:5] = torch.randint(1, 4097, (4, 1024), device=dev, dtype=torch.int32)
    rows = torch.arange(1, 5, device=dev)
    seq = torch.tensor([5, 9, 1, 17], dtype=torch.int32, device=dev)
    q = torch.randn(bs, HQ, D, device=dev, dtype=dt)
    z32 = torch.zeros(bs, dtype=torch.int32, device=dev)
    fb = ForwardBatch(mode=ForwardMode.DECODE, batch_size=bs, input_ids=rows, positions=rows, req_pool_indices=rows,
                      seq_lens=seq, extend_prefix_lens=z32, extend_seq_lens=z32 + 1, extend_start_loc=z32,
                      out_cache_loc=rows, req_to_token=r2t.req_to_token, kv_pool=pool, attn_backend=be)
    out = torch.empty_like(q)

    def step():
        be.init_forward_metadata(fb)
        out.copy_(be.forward_decode(q, 0, fb))

    from shared.engine.cuda_graph import capture_graph
    g = capture_graph(step, torch.cuda.Stream(dev), None)
    for lens in ([5, 9, 1, 17], [700, 3, 1024, 250]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        be.before_graph_replay(bs, lens)
        g.replay()
        ref_fb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows.tolist(), [n - 1 for n in lens], [1] * bs,
                                    rows, r2t.req_to_token, pool, TorchAttentionBackend(HQ, HKV, D), dev)
        ref = TorchAttentionBackend(HQ, HKV, D).forward_decode(q, 0, ref_fb)
        torch.testing.assert_close(out, ref, **_tol(dt))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [dict(head_dim=128, num_attention_heads=8, num_key_value_heads=2),
                                   dict(head_dim=128, num_attention_heads=8, num_key_value_heads=1, attention_bias=True)])
def test_engine_greedy_tokens_equal_the_triton_backend(tmp_path, monkeypatch, shape):
    """The whole engine (CUDA graphs, radix-cache hits extending over cached prefixes, batched decode) in bf16 with
    each backend: the same greedy tokens."""
    _needs_flashinfer()
    from tests.support.engine_harness import Harness
    from tests.support.hf_models import FAMILIES, make_hf_model, write_hf_checkpoint
    monkeypatch.setitem(FAMILIES, "fi", ("LlamaConfig", dict(shape, hidden_size=256)))
    path = write_hf_checkpoint(make_hf_model("fi"), str(tmp_path / "fi"))
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (150,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 1, 77, 9, 20)]
    runs = {}
    for backend in ("triton", "flashinfer"):
        h = Harness(model_path=path, attention_backend=backend, dtype="bfloat16", max_running_requests=16,
                    cuda_graph_max_bs=16)
        first = h.generate(prompts[0], sampling={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        rest = h.run([h.submit(p, sampling={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
                      for p in prompts[1:]])
        assert all(r["cached"] >= 150 for r in rest), [r["cached"] for r in rest]  # extends over a cached prefix
        runs[backend] = [first["ids"]] + [r["ids"] for r in rest]
        del h
        torch.cuda.empty_cache()
    assert runs["flashinfer"] == runs["triton"]
