"""FP8 checkpoints load with their scales honoured (greedy output equals transformers on the dequantized
weights), unsupported quantization is refused at load with a clear message, and --quantization fp8
quantizes a float model at load."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kernels.reference import fp8_linear_ref, quantize_fp8_per_token
from shared.models.forward_batch import ForwardMode
from shared.models.loader import load_model
from shared.models.quantization import UnsupportedQuantization, parse_quantization, quantize_per_channel
from tests.support.hf_models import PagedHarness, make_hf_model, paged_greedy, write_hf_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, granularity: str, block=(16, 16)):
    """(fp8 weight, stored scale) in one checkpoint family's layout."""
    if granularity == "tensor":
        scale = w.abs().max().float() / 448.0
        return (w / scale).clamp(-448, 448).to(FP8), scale.reshape(())
    if granularity == "channel":
        q, s = quantize_per_channel(w)
        return q, s[:, None]
    bn, bk = block
    n, k = w.shape
    s = torch.zeros(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=FP8)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s[i, j]).clamp(-448, 448).to(FP8)
    return q, s


def _dequantize(q: torch.Tensor, s: torch.Tensor, granularity: str, block=(16, 16)) -> torch.Tensor:
    if granularity in ("tensor", "channel"):
        return q.float() * s.float().reshape(-1, 1) if s.numel() > 1 else q.float() * s.float()
    bn, bk = block
    full = s.repeat_interleave(bn, 0)[: q.shape[0]].repeat_interleave(bk, 1)[:, : q.shape[1]]
    return q.float() * full


FORMATS = {
    # name: (quantization_config, granularity, scale suffix, extra tensors per layer)
    "fp8-per-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "weight_scale",
                              True),
    "fbgemm-per-channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "channel",
                           "weight_scale", False),
    "compressed-tensors-channel": ({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]}, "channel", "weight_scale", False),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}, "block",
                  "weight_scale_inv", False),
    # llm-compressor's FP8_BLOCK scheme, with the "mixed-precision" top-level format it may write.
    "compressed-tensors-block": ({
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": {
            "type": "float", "num_bits": 8, "strategy": "block", "block_structure": [16, 16], "symmetric": True},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 16,
                                  "dynamic": True}}},
        "ignore": ["lm_head"]}, "block", "weight_scale", False),
    # k_proj and v_proj have 16 rows: [32, 16] blocks do not tile them, so the weights are dequantized at load.
    "fp8-block-untiled": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 16]},
                          "block", "weight_scale_inv", False),
}


def write_fp8_checkpoint(hf, path: str, fmt: str):
    """Write `hf` quantized in format `fmt`; set `hf`'s own weights to the dequantized values (the
    reference transformers then runs)."""
    qconfig, granularity, suffix, input_scales = FORMATS[fmt]
    write_hf_checkpoint(hf, path)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    tensors = {}
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            mod = name.rsplit(".", 2)
            if name.endswith(".weight") and len(mod) == 3 and mod[1] in LINEARS:
                block = tuple(qconfig.get("weight_block_size", (16, 16)))
                q, s = _quantize(p.float(), granularity, block)
                tensors[name] = q
                tensors[name[: -len("weight")] + suffix] = s
                if input_scales:
                    tensors[name[: -len("weight")] + "input_scale"] = torch.tensor(0.05)
                hf.get_parameter(name).copy_(_dequantize(q, s, granularity, block))
            else:
                tensors[name] = p.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fmt, tmp_path):
    hf = make_hf_model("qwen2")  # qkv bias: scales and biases together
    path = write_fp8_checkpoint(hf, str(tmp_path / fmt), fmt)
    ours, cfg = load_model(path)
    layer = ours.model.layers[0]
    qkv_rows = cfg.q_size + 2 * cfg.kv_size
    if fmt == "fp8-block-untiled":  # blocks that do not tile the layers: dequantized at load, model dtype
        assert layer.mlp.down_proj.weight.dtype == torch.float32 and layer.mlp.down_proj.weight_scale is None
    elif FORMATS[fmt][1] == "block":  # FP8 with the checkpoint's block scales, stacked across fused projections
        assert layer.self_attn.qkv_proj.weight.dtype == FP8 and layer.self_attn.qkv_proj.weight_block == (16, 16)
        assert layer.self_attn.qkv_proj.weight_scale.shape == (qkv_rows // 16, cfg.hidden_size // 16)
        assert layer.mlp.down_proj.weight_scale.shape == (cfg.hidden_size // 16, cfg.intermediate_size // 16)
    else:
        assert layer.self_attn.qkv_proj.weight.dtype == FP8
        assert layer.self_attn.qkv_proj.weight_scale.shape == (qkv_rows,)
    prompt = torch.randint(3, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = PagedHarness(ours, cfg).step(ForwardMode.EXTEND, {0: prompt})[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4
    ours_greedy = paged_greedy(ours, cfg, [prompt], steps=6)[0]
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False)[0, len(prompt):].tolist()
    assert ours_greedy == hf_out


@pytest.mark.parametrize("qconfig,needle", [
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}, "int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}}, "int8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}}, "group"),
    ({"quant_method": "mxfp4"}, "mxfp4"),
])
def test_unsupported_quantization_is_refused_before_loading(qconfig, needle, tmp_path):
    hf = make_hf_model("llama2")
    path = write_hf_checkpoint(hf, str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedQuantization, match=needle):
        load_model(path)


def test_unknown_quantization_flag_is_refused():
    with pytest.raises(UnsupportedQuantization, match="int4"):
        parse_quantization({}, "int4")
    assert parse_quantization({}, "none") is None and parse_quantization({}, None) is None


def test_fp8_block_config_is_validated():
    with pytest.raises(UnsupportedQuantization, match="weight_block_size"):
        parse_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})

    def ct(*weights):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {f"g{i}": {"weights": {"type": "float", "num_bits": 8, **w}}
                                                          for i, w in enumerate(weights)}}}
    block = {"strategy": "block", "block_structure": [128, 128]}
    assert parse_quantization(ct(block)).block_size == (128, 128)
    assert parse_quantization(ct({"strategy": "block", "block_structure": "64x128"})).block_size == (64, 128)
    assert parse_quantization(ct({"strategy": "channel"})).block_size is None
    with pytest.raises(UnsupportedQuantization, match="block_structure"):
        parse_quantization(ct({"strategy": "block", "block_structure": [128]}))
    with pytest.raises(UnsupportedQuantization, match="mix weight strategies"):
        parse_quantization(ct(block, {"strategy": "channel"}))
    mixed = ct(block)
    mixed["quantization_config"]["format"] = "mixed-precision"  # groups without a format of their own
    with pytest.raises(UnsupportedQuantization, match="format"):
        parse_quantization(mixed)


def test_online_fp8_quantization_of_a_float_checkpoint(tmp_path):
    """--quantization fp8: every decoder linear held in FP8 with per-row scales; logits stay close to the
    float model's (per-channel e4m3 keeps ~3 significant bits, so close, not equal)."""
    hf = make_hf_model("llama31")
    path = write_hf_checkpoint(hf, str(tmp_path / "m"))
    ref_model, cfg = load_model(path)
    fp8_model, _ = load_model(path, quantization="fp8")
    linears = [m for n, m in fp8_model.named_modules() if hasattr(m, "weight_scale") and n != "lm_head"]
    assert len(linears) == 4 * cfg.num_hidden_layers and all(m.weight.dtype == FP8 for m in linears)
    assert fp8_model.lm_head.weight.dtype == torch.float32
    prompt = list(range(3, 40))
    a = PagedHarness(ref_model, cfg).step(ForwardMode.EXTEND, {0: prompt})[0]
    b = PagedHarness(fp8_model, cfg).step(ForwardMode.EXTEND, {0: prompt})[0]
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.99, float(cos)


def test_online_fp8_dummy_weights_and_tiny_random():
    model, _ = load_model("tiny-random", quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and torch.all(qkv.weight_scale > 0)


@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_the_mlp_gates_in_the_gate_up_epilogue_by_its_weights_dtype(quant, monkeypatch):
    """One-row MLP passes gate in gate_up_proj's epilogue for float weights, not for FP8 ones (measured apart: faster
    for bf16, a wash for FP8); passes of rows the GEMV takes gate there for FP8 weights, for float ones only at two
    rows on the GEMV's one-row kernel (measured apart too). Either way the output is the ungated MLP's."""
    import kernels.gemv as kg
    import kernels.ops as ops
    model, cfg = load_model("tiny-random", quantization=quant)
    mlp = model.model.layers[0].mlp
    calls = []
    gated_linear = ops.gated_linear
    monkeypatch.setattr(ops, "gated_linear", lambda x, *a, **kw: calls.append(x.shape[0]) or gated_linear(x, *a, **kw))

    def ungated(x):
        return mlp.down_proj(mlp.gate_up_proj(x), gated=True)

    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(model.lm_head.weight.dtype)
    torch.testing.assert_close(mlp(x), ungated(x))
    assert calls == ([] if quant == "fp8" else [1])
    calls.clear()
    x2 = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(x.dtype)
    torch.testing.assert_close(mlp(x2), ungated(x2))
    assert calls == []  # two rows on the CPU: no GEMV takes them
    monkeypatch.setattr(ops, "gemv_applies", lambda x, w, s=None: x.shape[0] <= 16)  # as on a GPU
    monkeypatch.setattr(ops, "two_row_gating_applies", lambda x, w, s=None: x.shape[0] == 2 and not kg.on_tensor_cores(
        2, w, s))
    monkeypatch.setattr(ops, "gated_linear", lambda x, w, b=None, s=None, norm_in=None:
                        calls.append(x.shape[0]) or ops.silu_and_mul(ops.linear(x, w, b, s)))
    for m in (2, 4, 17):
        calls.clear()
        xm = torch.randn(m, cfg.hidden_size, generator=torch.Generator().manual_seed(m)).to(x.dtype)
        torch.testing.assert_close(mlp(xm), ungated(xm))
        want = m <= 16 if quant == "fp8" else m == 2  # 17 rows: past the GEMV; 4 float rows: its tensor-core tile
        assert calls == ([m] if want else []), (m, calls)


def test_fp8_rows_take_the_gemv_up_to_gemv_max_m_fp8_and_only_with_per_row_scales(monkeypatch):
    """kernels.ops' dispatch on a (pretended) GPU: bf16 weights take the GEMV at GEMV_MAX_M rows; FP8 weights with
    per-row scales up to GEMV_MAX_M_FP8 rows, block-scaled ones at one row; the rest go to the GEMMs."""
    import kernels.ops as ops
    monkeypatch.setattr(ops, "_on_gpu", lambda x: True)
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    q, row_scale = quantize_per_channel(w.float())
    block_scale = torch.ones(1, 1)
    for knob, bf16_rows in ((1, 16), (8, 1)):  # each limit alone: neither widens the other's
        monkeypatch.setattr(ops, "GEMV_MAX_M_FP8", knob)
        monkeypatch.setattr(ops, "GEMV_MAX_M", bf16_rows)
        for m in (1, 2, 8, 9):
            x = torch.zeros(m, 32, dtype=torch.bfloat16)
            assert ops._gemv_applies(x, w, None) == (m <= ops.GEMV_MAX_M)
            assert ops._gemv_applies(x, q, row_scale) == (m <= knob), (knob, m)
            assert ops._gemv_applies(x, q, block_scale) == (m == 1)
    assert not ops._gemv_applies(torch.zeros(2, 64, dtype=torch.bfloat16)[:, ::2], q, row_scale)  # strided rows


def test_two_row_gating_applies_where_two_rows_take_the_one_row_kernel_with_the_epilogue(monkeypatch):
    """kernels.ops.two_row_gating_applies on a (pretended) GPU: two rows of bf16 or per-row-scaled FP8 weights on the
    GEMV's one-row kernel with the gating epilogue; not one or three rows, not block-scaled weights."""
    import kernels.ops as ops
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    q, row_scale = quantize_per_channel(w.float())
    x = {m: torch.zeros(m, 32, dtype=torch.bfloat16) for m in (1, 2, 3)}
    assert not ops.two_row_gating_applies(x[2], w)  # the CPU: no GEMV
    monkeypatch.setattr(ops, "_on_gpu", lambda x: True)
    assert ops.two_row_gating_applies(x[2], w)
    assert ops.two_row_gating_applies(x[2], q, row_scale)
    assert not ops.two_row_gating_applies(x[2], q, torch.ones(1, 1))  # block scales
    assert not ops.two_row_gating_applies(x[1], w) and not ops.two_row_gating_applies(x[3], w)


def test_logits_of_2_to_16_bf16_rows_come_from_the_gemv_into_the_graph_buffer(monkeypatch):
    """LlamaForCausalLM.compute_logits on a (pretended) GPU, into a logits buffer of the model's dtype: bf16 rows up to
    kernels.ops.GEMV_MAX_M go to the GEMV with the buffer as its output, more rows or another dtype go to torch.mm."""
    import types

    import kernels.gemv as kg
    import kernels.ops as ops
    import shared.models.llama as llama
    calls = []
    monkeypatch.setattr(ops, "_on_gpu", lambda x: True)
    monkeypatch.setattr(kg, "gemv", lambda x, w, out=None, **kw: calls.append(x.shape[0]) or out.fill_(7))
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(40, 16).to(dtype)
        model = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=w, shard=None), logits_dtype=dtype)
        for m in (1, 2, 16, 17):
            calls.clear()
            x, out = torch.randn(m, 16).to(dtype), torch.empty(m, 40, dtype=dtype)
            got = llama.LlamaForCausalLM.compute_logits(model, x, out=out)
            gemv = dtype == torch.bfloat16 and m <= ops.GEMV_MAX_M
            assert got.data_ptr() == out.data_ptr() and calls == ([m] if gemv else [])
            assert torch.equal(got, torch.full_like(out, 7)) if gemv else torch.equal(got, x @ w.t())


def test_fp8_linear_reference_and_activation_quantization():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen)
    q, s = quantize_per_channel(w)
    x = torch.randn(5, 32, generator=gen)
    y = fp8_linear_ref(x, q, s)
    assert torch.allclose(y, x @ (q.float() * s[:, None]).t(), atol=1e-5)
    assert float((y - x @ w.t()).abs().max() / (x @ w.t()).abs().max()) < 0.1
    xq, xs = quantize_fp8_per_token(x)
    assert xq.dtype == FP8 and xs.shape == (5, 1)
    assert float((xq.float() * xs - x).abs().max() / x.abs().max()) < 0.07


@pytest.mark.gpu  # FP8 GEMM and GEMV need a GPU
@pytest.mark.parametrize("scales", ["per_channel", "blocks"])
def test_fp8_kernels_on_gpu(scales):
    """FP8 weights through ops on the GPU, per-row scales or [128, 128] block scales: one row in the GEMV, more in
    the FP8 GEMM (torch._scaled_mm per token; the block GEMM after per-group activation quantization), the gated
    down projection's input quantized in the same kernel."""
    from kernels.ops import fp8_linear, silu_mul_linear
    from kernels.reference import silu_and_mul_ref
    from shared.models.quantization import quantize_blocks

    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(1, 4096, 4096), (1, 1024, 4096), (7, 512, 256), (64, 4096, 1024), (300, 1024, 512)]:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q, s = quantize_blocks(w, (128, 128)) if scales == "blocks" else quantize_per_channel(w)
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = fp8_linear_ref(x.float(), q, s)
        y = fp8_linear(x, q, s).float()
        assert float((y - ref).abs().max() / ref.abs().max()) < 0.05, (m, n, k)
        # The down projection's path: the gated activation quantized in the same kernel (M > 1: the GEMM).
        h = torch.randn(m, 2 * k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = fp8_linear_ref(silu_and_mul_ref(h).float(), q, s)
        y = silu_mul_linear(h, q, None, s).float()
        assert float((y - ref).abs().max() / ref.abs().max()) < 0.05, ("silu_mul", m, n, k)


@pytest.mark.gpu
def test_block_fp8_checkpoint_on_gpu_matches_the_cpu_reference(tmp_path):
    """A block-scaled FP8 checkpoint on the GPU in bf16 (block GEMM for the prompt, the GEMV for one decode
    token) against the same checkpoint on the CPU (weights dequantized, fp32): logits to within W8A8's and
    bf16's rounding, and the same next token wherever the reference's leads by more than that."""
    hf = make_hf_model("qwen2")
    path = write_fp8_checkpoint(hf, str(tmp_path / "block"), "fp8-block")
    cpu, cfg = load_model(path)
    gpu, _ = load_model(path, dtype=torch.bfloat16, device="cuda")
    assert gpu.model.layers[0].mlp.gate_up_proj.weight_block == (16, 16)
    prompt = torch.randint(3, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    runs, token = [], None
    for model in (cpu, gpu):  # both decode the token the reference picks
        h = PagedHarness(model, cfg)
        logits = h.step(ForwardMode.EXTEND, {0: prompt})[0].cpu()
        token = int(logits[-1].argmax()) if token is None else token
        runs.append((logits, h.step(ForwardMode.DECODE, {0: [token]})[0].cpu()))
    for want, got in zip(runs[0], runs[1]):
        err = float((got - want).abs().max())
        assert err < 0.1 * float(want.abs().max())
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err  # rows whose argmax no rounding of this size can flip
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_block_fp8_dummy_weights_keep_blocks(tmp_path):
    """--load-format dummy on a block-scaled FP8 config (how a benchmark runs one without its checkpoint):
    FP8 layers with block scales, drawn through quantize_blocks, so the dequantized weights are the draw's."""
    from shared.models.quantization import quantize_blocks

    hf = make_hf_model("qwen2")
    path = write_fp8_checkpoint(hf, str(tmp_path / "block"), "fp8-block")
    model, cfg = load_model(path, load_format="dummy")
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8 and down.weight_scale.shape == (cfg.hidden_size // 16, cfg.intermediate_size // 16)
    deq = fp8_linear_ref(torch.eye(cfg.intermediate_size), down.weight, down.weight_scale).t()
    q, s = quantize_blocks(deq, (16, 16))
    assert float((_dequantize(q, s, "block") - deq).abs().max()) <= 1e-3 * float(deq.abs().max())
    assert 0.005 < float(deq.std()) < 0.05  # the draw's scale (normal, std 0.02)


@pytest.mark.parametrize("fmt,flags,want", [("fp8-block", {}, "float32"),
                                            ("fp8-block", {"dequantize_fp8_blocks": False},
                                             "fp8_e4m3, a scale per [16, 16] block"),
                                            ("fp8-block-untiled", {"dequantize_fp8_blocks": False}, "float32"),
                                            ("fbgemm-per-channel", {}, "fp8_e4m3, a scale per row")])
def test_engine_info_says_how_the_weights_are_held(fmt, flags, want, tmp_path):
    """engine.info()'s weight_format: whether a block-scaled checkpoint kept its blocks (an operator's check of
    which path runs: dequantized at load by default, FP8 blocks with --fp8-block-kernels where they tile; per-row
    scales are not touched by either), and the engine serves from the checkpoint either way."""
    from tests.support.engine_harness import Harness

    path = write_fp8_checkpoint(make_hf_model("qwen2"), str(tmp_path / fmt), fmt)
    h = Harness(model_path=path, **flags)
    try:
        assert h.engine.info()["weight_format"] == want
        out = h.run([h.submit([5, 6, 7], sampling={"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})])
        assert len(out[0]["ids"]) == 3
    finally:
        h.engine.stop()
