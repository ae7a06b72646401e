"""Our Llama-family model against `transformers` on tiny random checkpoints of every supported family:
prefill logits through the paged KV path, extend over a cached prefix, and batched greedy decoding."""
from __future__ import annotations

import pytest
import torch

from shared.models.forward_batch import ForwardMode
from shared.models.loader import load_model
from tests.support.hf_models import FAMILIES, PagedHarness, make_hf_model, paged_greedy, write_hf_checkpoint

PROMPT_LENS = [5, 17, 11]
PREFIX_LENS = [3, 9, 1]  # cached part of each prompt in the extend test
DECODE_STEPS = 8
REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(hf_model, our_model, our_config, prompts) for one family, built once per module."""
    name = request.param
    hf = make_hf_model(name)
    path = write_hf_checkpoint(hf, str(tmp_path_factory.mktemp(name)))
    ours, cfg = load_model(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return hf, ours, cfg, prompts


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def test_config_flags_match_family(family):
    hf, _, cfg, _ = family
    hc = hf.config
    assert cfg.architecture == type(hf).__name__
    assert cfg.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings
    assert cfg.attention_bias == (hf.model.layers[0].self_attn.q_proj.bias is not None)
    assert cfg.qk_norm == hasattr(hf.model.layers[0].self_attn, "q_norm")


def test_prefill_logits_match(family):
    hf, ours, cfg, prompts = family
    logits = PagedHarness(ours, cfg).step(ForwardMode.EXTEND, dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        assert logits[i].dtype == torch.float32 and logits[i].shape == (len(p), cfg.vocab_size)
        assert rel_err(logits[i], hf_logits(hf, p)) < REL_TOL


def test_logits_into_a_model_dtype_buffer_are_the_gemms_own(tmp_path):
    """The CUDA-graph runner's logits buffer has the lm_head's dtype: the GEMM writes it directly, the
    same values as the fresh (widened) logits, rounded as the GEMM rounds them; other dtypes and TP still
    take the copy."""
    path = write_hf_checkpoint(make_hf_model("llama31"), str(tmp_path / "m"))
    ours, cfg = load_model(path, dtype=torch.bfloat16)
    assert ours.logits_dtype == torch.bfloat16
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    fresh = ours.compute_logits(h)
    assert fresh.dtype == torch.float32
    into = torch.full((5, cfg.vocab_size), float("nan"), dtype=torch.bfloat16)
    assert ours.compute_logits(h, out=into) is into
    assert torch.equal(into.float(), fresh)
    wide = torch.empty(5, cfg.vocab_size, dtype=torch.float32)
    assert torch.equal(ours.compute_logits(h, out=wide), fresh)


def test_extend_over_cached_prefix_matches(family):
    hf, ours, cfg, prompts = family
    h = PagedHarness(ours, cfg)
    h.step(ForwardMode.EXTEND, {i: p[:n] for i, (p, n) in enumerate(zip(prompts, PREFIX_LENS))})
    logits = h.step(ForwardMode.EXTEND, {i: p[n:] for i, (p, n) in enumerate(zip(prompts, PREFIX_LENS))})
    for i, (p, n) in enumerate(zip(prompts, PREFIX_LENS)):
        assert rel_err(logits[i], hf_logits(hf, p)[n:]) < REL_TOL


def test_greedy_decode_matches_generate(family):
    hf, ours, cfg, prompts = family
    got = paged_greedy(ours, cfg, prompts, DECODE_STEPS)
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=DECODE_STEPS + 1)
        assert toks == ref[0, len(p):].tolist()


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_rope_writes_contiguous_qkv_only_for_a_backend_that_reads_them(mode):
    """The rope + KV-store step copies q, k, v out of the fused qkv output only where it pays: extend
    passes of the Triton backend (its kernel streams them); decode, and the torch backend (which reads
    the pool), rotate in place."""
    from types import SimpleNamespace

    from shared.models.attention.torch_backend import TorchAttentionBackend
    from shared.models.attention.triton_backend import TritonAttentionBackend
    asked = []

    class Rotary:
        def rotate_and_store(self, positions, q, k, v, k_buf, v_buf, loc, out=False, kv_scales=(1.0, 1.0)):
            asked.append(out)
            return q, k, v
    fb = SimpleNamespace(mode=mode, positions=None, out_cache_loc=None,
                         kv_pool=SimpleNamespace(get_kv=lambda layer: (None, None), scales=[(1.0, 1.0)]))
    q, kv = torch.zeros(3, 4 * 8), torch.zeros(3, 2 * 8)
    for cls in (TritonAttentionBackend, TorchAttentionBackend):
        backend = cls(4, 2, 8)
        backend.forward_extend = backend.forward_decode = lambda q, *a, **kw: q
        backend.forward(q, kv, kv.clone(), 0, fb, rotary=Rotary())
    assert asked == [mode == ForwardMode.EXTEND, False]


def test_split_row_norms_match_unsplit_passes(family):
    """One-token passes with every residual norm after the first split between the GEMVs around it
    (kernels/residual_norm.py, here its torch path), the final one too (into the lm_head): the same logits as the
    unsplit passes, step by step through a prompt fed one token at a time then greedy decoding, and the same tokens as
    transformers."""
    hf, ours, cfg, prompts = family
    prompt = prompts[0]
    if cfg.o_proj_bias or cfg.mlp_bias:  # a biased producer keeps its norms whole
        assert not ours.model.split_row_norms(True) and ours.model.row_norm_sums is None
        return
    runs = {}
    for split in (False, True):
        assert ours.model.split_row_norms(split) == split
        try:
            h, logits = PagedHarness(ours, cfg), []
            for t in prompt:  # EXTEND passes of one token
                logits.append(h.step(ForwardMode.EXTEND, {0: [t]})[0][-1])
            toks = [int(logits[-1].argmax())]
            for _ in range(DECODE_STEPS):
                logits.append(h.step(ForwardMode.DECODE, {0: toks[-1:]})[0][-1])
                toks.append(int(logits[-1].argmax()))
            runs[split] = torch.stack(logits), toks
            if split:  # the split pass ran: its partial sums hold the last step's sums of squares
                sums = ours.model.row_norm_sums.sum(1)
                assert bool((sums > 0).all())
        finally:
            ours.model.split_row_norms(False)
    assert rel_err(runs[True][0], runs[False][0]) < REL_TOL
    assert runs[True][1] == runs[False][1]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=DECODE_STEPS + 1)
    assert runs[True][1] == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("rope", [False, True])
def test_two_row_split_norms_match_unsplit_passes(family, rope, monkeypatch):
    """Two-token passes down the one-token path with their residual norms split, each row its own partial sums
    (on a pretended GPU whose GEMV takes both rows on its one-row kernel; the torch path
    here), rope and the KV store in qkv_proj's epilogue too with rope: two requests' prompt and greedy decode steps give
    the logits and tokens of the unsplit passes."""
    import kernels.ops as ops
    hf, ours, cfg, prompts = family
    if cfg.o_proj_bias or cfg.mlp_bias:
        pytest.skip("a biased producer keeps its norms whole (test_split_row_norms_match_unsplit_passes)")
    if rope and (cfg.qk_norm or cfg.attention_bias):
        pytest.skip("q/k norms or a qkv bias: fuse_row_rope refuses")
    asked = []
    monkeypatch.setattr(ops, "two_row_norms_apply", lambda x, ws: asked.append(x.shape) or x.shape[0] == 2)
    if rope:
        monkeypatch.setattr(ops, "gemv_applies", lambda x, w, s=None: x.shape[0] <= 16)
    a, b = prompts[0], prompts[1]
    runs = {}
    for split in (False, True):
        assert ours.model.split_row_norms(split) == split
        assert ours.model.fuse_row_rope(rope) == rope
        try:
            runs[split] = _two_request_run(ours, cfg, a, b)
            if split:  # the two-row passes ran: each row's partial sums hold its last step's sums of squares
                assert bool((ours.model.row2_norm_sums[:-1].sum(-1) > 0).all())  # the last: the final norm's (one row)
        finally:
            ours.model.split_row_norms(False)
            ours.model.fuse_row_rope(False)
    assert asked and all(shape[0] == 2 for shape in asked)
    assert rel_err(runs[True][0], runs[False][0]) < REL_TOL
    assert runs[True][1] == runs[False][1]


def _two_request_run(ours, cfg, a, b):
    """Two prompts in one extend pass, then greedy decode passes of both rows: (logits [steps, 2, V], tokens)."""
    h, logits = PagedHarness(ours, cfg), []
    first = h.step(ForwardMode.EXTEND, {0: a, 1: b})
    toks = {0: [int(first[0][-1].argmax())], 1: [int(first[1][-1].argmax())]}
    for _ in range(DECODE_STEPS):
        out = h.step(ForwardMode.DECODE, {r: t[-1:] for r, t in toks.items()})
        logits.append(torch.stack([out[0][-1], out[1][-1]]))
        for r in toks:
            toks[r].append(int(out[r][-1].argmax()))
    return torch.stack(logits), toks


def _one_token_run(ours, cfg, prompt, backend=None, forced=None):
    """A prompt fed one token a pass (extend passes), then greedy decode passes: (logits, tokens). `forced`: the
    tokens to decode instead of this run's own argmax (another run's), so that two runs' logits are compared at
    the same inputs even where a near tie would make their greedy paths part."""
    h, logits = PagedHarness(ours, cfg, backend=backend), []
    for t in prompt:
        logits.append(h.step(ForwardMode.EXTEND, {0: [t]})[0][-1])
    toks = [int(logits[-1].argmax())]
    for i in range(DECODE_STEPS):
        fed = forced[i] if forced is not None else toks[-1]
        logits.append(h.step(ForwardMode.DECODE, {0: [fed]})[0][-1])
        toks.append(int(logits[-1].argmax()))
    return torch.stack(logits), toks


def test_rope_in_the_qkv_epilogue_matches_the_rope_kernel(family, monkeypatch):
    """One-token decode passes with rope and the KV store in qkv_proj's epilogue (kernels/rope_store.py, here
    its torch path), with whole and split norms: the logits and tokens of the backend's rope + KV-store step,
    which then runs only in the extend passes; refused where q/k norms or a qkv bias come between."""
    hf, ours, cfg, prompts = family
    if cfg.qk_norm or cfg.attention_bias:
        assert not ours.model.fuse_row_rope(True)
        return
    rotations = []
    rotate = ours.model.rotary_emb.rotate_and_store
    monkeypatch.setattr(ours.model.rotary_emb, "rotate_and_store",
                        lambda positions, *a, **kw: rotations.append(positions.shape[0]) or rotate(positions, *a, **kw))
    runs = {}
    for split in (False, True):
        for fused in (False, True):
            assert ours.model.fuse_row_rope(fused) == fused and ours.model.split_row_norms(split) == split
            rotations.clear()
            try:
                runs[split, fused] = _one_token_run(ours, cfg, prompts[1])
            finally:
                ours.model.fuse_row_rope(False)
                ours.model.split_row_norms(False)
            passes = len(prompts[1]) + (0 if fused else DECODE_STEPS)
            assert len(rotations) == passes * cfg.num_hidden_layers, "rope ran where the epilogue should have"
    for split in (False, True):
        assert rel_err(runs[split, True][0], runs[split, False][0]) < REL_TOL
        assert runs[split, True][1] == runs[split, False][1]


def test_rope_in_the_qkv_epilogue_at_several_rows_matches_the_rope_kernel(family, monkeypatch):
    """Decode passes of two rows with rope and the KV store in qkv_proj's epilogue (on a pretended GPU whose GEMV
    takes the rows; the epilogue's torch path here), each row at its own position and slot: the logits and tokens of
    the backend's rope + KV-store step (without the fusion), which then runs only in the extend passes."""
    import kernels.ops as ops
    hf, ours, cfg, prompts = family
    if cfg.qk_norm or cfg.attention_bias:
        pytest.skip("q/k norms or a qkv bias: fuse_row_rope refuses (test_rope_in_the_qkv_epilogue_matches_...)")
    monkeypatch.setattr(ops, "gemv_applies", lambda x, w, s=None: x.shape[0] <= 16)
    rotations = []
    rotate = ours.model.rotary_emb.rotate_and_store
    monkeypatch.setattr(ours.model.rotary_emb, "rotate_and_store",
                        lambda positions, *a, **kw: rotations.append(positions.shape[0]) or rotate(positions, *a, **kw))
    a, b = prompts[0], prompts[1]
    runs = {}
    for rows in (False, True):
        assert ours.model.fuse_row_rope(rows) == rows
        rotations.clear()
        try:
            runs[rows] = _two_request_run(ours, cfg, a, b)
        finally:
            ours.model.fuse_row_rope(False)
        # The rope kernel: once a layer in the extend pass, and in the decode passes only without the fusion.
        assert len(rotations) == (1 + (0 if rows else DECODE_STEPS)) * cfg.num_hidden_layers, rotations
    assert rel_err(runs[True][0], runs[False][0]) < REL_TOL
    assert runs[True][1] == runs[False][1]


def test_fp8_qkv_weights_refuse_the_rope_epilogue(tmp_path):
    """--decode-rope-fusion is on by default; with FP8 qkv weights the model keeps the rope kernel (the FP8 GEMV with
    the epilogue cost more than the kernel it saved); with bf16 or fp32 ones it fuses."""
    path = write_hf_checkpoint(make_hf_model("llama31"), str(tmp_path / "m"))
    fp8, _ = load_model(path, quantization="fp8")
    assert fp8.model.fuse_row_rope(True) is False
    plain, _ = load_model(path)
    assert plain.model.fuse_row_rope(True) is True


def _mlp_forward(gated: bool):
    """LlamaMLP.forward with the MLP gated in gate_up_proj's epilogue, or with silu_and_mul in down_proj's input,
    whatever the model's choice by dtype and rows."""
    def forward(self, x, norm_in=None, add_norm=None):
        if gated:
            return self.down_proj(self.gate_up_proj(x, norm_in=norm_in, gated_out=True), add_norm=add_norm)
        return self.down_proj(self.gate_up_proj(x, norm_in=norm_in), gated=True, add_norm=add_norm)
    return forward


def test_mlp_gated_in_the_gate_up_epilogue_matches(family, monkeypatch):
    """One-token passes with the MLP gated in gate_up_proj's epilogue (here ops.gated_linear's torch path), whole and
    split norms: the logits and tokens of silu_and_mul in down_proj's input, and the epilogue's op called once a
    layer a pass where gated. On the CPU this checks the wiring
    (the torch path runs the same ops either way); the kernel's bits are check_gemv_gated_out's."""
    import kernels.ops as ops
    import shared.models.llama as llama
    hf, ours, cfg, prompts = family
    calls = []
    gated_linear = ops.gated_linear
    monkeypatch.setattr(ops, "gated_linear", lambda x, *a, **kw: calls.append(x.shape[0]) or gated_linear(x, *a, **kw))
    splits = (False,) if cfg.o_proj_bias or cfg.mlp_bias else (False, True)
    runs = {}
    for split in splits:
        for gated in (False, True):
            monkeypatch.setattr(llama.LlamaMLP, "forward", _mlp_forward(gated))
            assert ours.model.split_row_norms(split) == split
            calls.clear()
            try:
                runs[split, gated] = _one_token_run(ours, cfg, prompts[0])
            finally:
                ours.model.split_row_norms(False)
            dense = sum(isinstance(layer.mlp, llama.LlamaMLP) for layer in ours.model.layers)
            assert calls == ([1] * dense * (len(prompts[0]) + DECODE_STEPS) if gated else []), (split, gated)
    for split in splits:
        assert rel_err(runs[split, True][0], runs[split, False][0]) < REL_TOL
        assert runs[split, True][1] == runs[split, False][1]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_mlp_gated_in_the_gate_up_epilogue_on_cuda(tmp_path, quant, monkeypatch):
    """The Triton path of the gate | up GEMV's gating epilogue against silu_and_mul in
    down_proj's load, bf16 and FP8 weights, whole and split norms: the same logits bit for bit (the tiny model's
    gate_up is unsplit either way, and down_proj reads the same activation bits) and the same tokens."""
    import shared.models.llama as llama
    from shared.models.attention import create_attention_backend
    path = write_hf_checkpoint(make_hf_model("llama31"), str(tmp_path / f"llama31-{quant}"))
    ours, cfg = load_model(path, dtype=torch.bfloat16, device=torch.device("cuda"), quantization=quant)
    prompt = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(21)).tolist()
    runs = {}
    for split in (False, True):
        for gated in (False, True):
            monkeypatch.setattr(llama.LlamaMLP, "forward", _mlp_forward(gated))
            assert ours.model.split_row_norms(split) == split
            backend = create_attention_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim, device=torch.device("cuda"))
            try:
                runs[split, gated] = _one_token_run(ours, cfg, prompt, backend=backend)
            finally:
                ours.model.split_row_norms(False)
    for split in (False, True):
        assert torch.equal(runs[split, True][0], runs[split, False][0]), (split, rel_err(runs[split, True][0],
                                                                                       runs[split, False][0]))
        assert runs[split, True][1] == runs[split, False][1], split


def _cuda_one_token_runs(tmp_path, quant: str, seed: int, settings: dict, teacher_forced: bool = False) -> dict:
    """bf16 llama31 on the GPU with the Triton attention backend: _one_token_run under each of `settings`
    ({key: (split norms (the final one folded into the lm_head too), rope in the epilogue)}); teacher_forced: every
    run decodes the first run's greedy tokens."""
    from shared.models.attention import create_attention_backend
    path = write_hf_checkpoint(make_hf_model("llama31"), str(tmp_path / f"llama31-{quant}"))
    ours, cfg = load_model(path, dtype=torch.bfloat16, device=torch.device("cuda"), quantization=quant)
    prompt = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    runs = {}
    for key, (split, rope) in settings.items():
        assert ours.model.split_row_norms(split) == split
        assert ours.model.fuse_row_rope(rope) == (rope and quant == "none")  # FP8 qkv weights keep the rope kernel
        backend = create_attention_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads,
                                           cfg.head_dim, device=torch.device("cuda"))
        first = next(iter(runs.values()), None)
        forced = first[1] if teacher_forced and first is not None else None
        runs[key] = _one_token_run(ours, cfg, prompt, backend=backend, forced=forced)
    return runs


@pytest.mark.gpu
def test_rope_in_the_qkv_epilogue_on_cuda_in_bf16(tmp_path):
    """The Triton path of rope + KV store in the qkv GEMV's epilogue against the rope kernel, bf16, the Triton
    attention backend, split norms on and off: decode logits to within bf16's rounding."""
    runs = _cuda_one_token_runs(tmp_path, "none", 5, {(s, r): (s, r) for s in (False, True) for r in (False, True)})
    for split in (False, True):
        assert rel_err(runs[split, True][0], runs[split, False][0]) < 2e-2, split


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_final_norm_in_the_lm_head_on_cuda(tmp_path, quant):
    """The final norm split into the last down_proj and the lm_head GEMV (with the split norms), fp32 logits from
    the GEMV's sums, against the final norm kernel and cuBLAS's lm_head (whole norms): the same logits to within
    bf16's rounding of them. Since the fold is no longer switched apart from the split norms, both differences are
    in one run, so its decode passes take the whole-norm run's tokens (a near tie must not part the inputs)."""
    runs = _cuda_one_token_runs(tmp_path, quant, 13, {fold: (fold, False) for fold in (False, True)},
                                teacher_forced=True)
    assert rel_err(runs[True][0], runs[False][0]) < 2e-2


@pytest.mark.gpu
def test_split_row_norms_on_cuda_in_bf16(tmp_path):
    """The Triton path of the split norms (GEMV epilogues, the first norm clearing the sums) against whole
    norms on the GPU, bf16, the Triton attention backend: one-token passes give the same logits to within
    bf16's rounding, for plain and FP8 weights and a biased qkv_proj."""
    from shared.models.attention import create_attention_backend
    for name, quant in (("llama31", "none"), ("llama31", "fp8"), ("qwen2", "none")):  # qwen2: a consumer's bias
        path = write_hf_checkpoint(make_hf_model(name), str(tmp_path / name))
        ours, cfg = load_model(path, dtype=torch.bfloat16, device=torch.device("cuda"), quantization=quant)
        prompt = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
        runs = {}
        for split in (False, True):
            assert ours.model.split_row_norms(split) == split
            backend = create_attention_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim, device=torch.device("cuda"))
            h = PagedHarness(ours, cfg, backend=backend)
            runs[split] = torch.stack([h.step(ForwardMode.EXTEND, {0: [t]})[0][-1] for t in prompt])
        ours.model.split_row_norms(False)
        assert rel_err(runs[True], runs[False]) < 2e-2, (name, quant)
