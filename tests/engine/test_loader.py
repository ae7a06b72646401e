"""Checkpoint loading (single file, sharded, tied, tiny-random) and config parsing."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.models.forward_batch import ForwardMode
from shared.models.config import ModelConfig
from shared.models.loader import load_model
from shared.models.weights import build_empty_model
from shared.models.tiny_random import build_tiny_random_model, save_tiny_random_checkpoint, tiny_random_config
from shared.tokenizer import Tokenizer
from tests.support.hf_models import PagedHarness, make_hf_model, paged_greedy, write_hf_checkpoint

LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA31_LEGACY = {  # a Llama-3.1-8B config.json as transformers 4.x wrote it
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "rope_scaling": LLAMA31_ROPE,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
PROMPT = [11, 42, 7, 300, 5, 99]


def prefill_logits(model, cfg, prompt=PROMPT) -> torch.Tensor:
    return PagedHarness(model, cfg).step(ForwardMode.EXTEND, {0: prompt})[0]


def hf_state(hf) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in hf.state_dict().items()}


# ------------------------------------------------------------------ checkpoints
def test_fused_weights_are_stacked_from_hf_tensors(tmp_path):
    hf = make_hf_model("qwen2")
    model, _ = load_model(write_hf_checkpoint(hf, str(tmp_path)))
    sd, attn = hf_state(hf), model.model.layers[1].self_attn
    pre = "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([sd[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([sd[pre + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight,
                       torch.cat([sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]]))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    hf = make_hf_model("llama31")
    single, _ = load_model(write_hf_checkpoint(hf, str(tmp_path / "single")))
    sharded_dir = write_hf_checkpoint(hf, str(tmp_path / "sharded"), max_shard_size="100KB")
    index = json.load(open(os.path.join(sharded_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    assert not os.path.exists(os.path.join(sharded_dir, "model.safetensors"))
    sharded, cfg = load_model(sharded_dir)
    for (n1, p1), (n2, p2) in zip(single.named_parameters(), sharded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(prefill_logits(single, cfg), prefill_logits(sharded, cfg))


def test_tied_embeddings_share_one_tensor(tmp_path):
    hf = make_hf_model("tied")
    path = write_hf_checkpoint(hf, str(tmp_path))
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    model, cfg = load_model(path)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf_state(hf)["model.embed_tokens.weight"])


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    path = write_hf_checkpoint(make_hf_model("tied"), str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # derived state, skipped
    save_file(sd, file, metadata={"format": "pt"})
    model, _ = load_model(path)
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])


def test_missing_weight_is_named(tmp_path):
    path = write_hf_checkpoint(make_hf_model("llama2"), str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 required weight.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path):
    path = write_hf_checkpoint(make_hf_model("llama2"), str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    sd["model.norm.weight"] = torch.ones(3)
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        load_model(path)


def test_unknown_architecture_is_refused(tmp_path):
    path = write_hf_checkpoint(make_hf_model("llama2"), str(tmp_path))
    cfg_file = os.path.join(path, "config.json")
    d = json.load(open(cfg_file))
    d["architectures"], d["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    json.dump(d, open(cfg_file, "w"))
    with pytest.raises(ValueError, match=r"unsupported model architecture.*GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(path)


def test_dtype_choice(tmp_path):
    path = write_hf_checkpoint(make_hf_model("qwen3"), str(tmp_path))
    model, _ = load_model(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model, cfg = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32  # positions stay exact
    logits = prefill_logits(model, cfg)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("scaling", [
    None, {"rope_type": "linear", "factor": 2.0}, LLAMA31_ROPE,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_model_builds_on_the_context_device(scaling):
    """Construction under a device context (meta here, cuda in serving) must not mix devices."""
    cfg = ModelConfig.from_hf({**LLAMA31_LEGACY, "num_hidden_layers": 1, "max_position_embeddings": 256,
                               "rope_scaling": scaling})
    model = build_empty_model(cfg, torch.bfloat16, "meta")
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    cache = model.model.rotary_emb.cos_sin_cache
    assert cache.is_meta and cache.dtype == torch.float32 and cache.shape == (256, cfg.head_dim)


# ------------------------------------------------------------------ tiny-random
def test_tiny_random_memory_and_disk_agree(tmp_path):
    mem, mem_cfg = load_model("tiny-random")
    save_tiny_random_checkpoint(str(tmp_path))
    disk, disk_cfg = load_model(str(tmp_path))
    assert mem_cfg == disk_cfg == tiny_random_config()
    for (n1, p1), (n2, p2) in zip(mem.named_parameters(), disk.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(prefill_logits(mem, mem_cfg), prefill_logits(disk, disk_cfg))
    tok = Tokenizer.load(str(tmp_path))
    assert tok.eos_token_ids == disk_cfg.eos_token_ids == [2]
    assert tok.vocab_size <= disk_cfg.vocab_size


def test_tiny_random_checkpoint_is_a_valid_hf_model(tmp_path):
    import transformers

    save_tiny_random_checkpoint(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model, cfg = load_model(str(tmp_path))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert float((prefill_logits(model, cfg) - ref).abs().max() / ref.abs().max()) < 1e-4


def test_tiny_random_is_deterministic_and_not_degenerate():
    cfg = tiny_random_config()
    assert cfg.vocab_size >= Tokenizer.load("tiny-random").vocab_size
    assert cfg.eos_token_ids == [2] and cfg.context_length == 4096
    a, b = build_tiny_random_model(), build_tiny_random_model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    logits = prefill_logits(a, cfg)
    probs = torch.softmax(logits, -1)
    assert logits.std() > 1.0  # not a flat distribution...
    assert (probs.max(-1).values < 0.999).all()  # ...nor a one-hot one
    out = paged_greedy(a, cfg, [PROMPT, PROMPT[:3]], steps=15)
    assert len(set(out[0])) >= 4 and out[0] != out[1]  # continuation depends on the prompt


# ------------------------------------------------------------------ config parsing
def test_legacy_and_v5_rope_layouts_parse_the_same():
    legacy = ModelConfig.from_hf(LLAMA31_LEGACY)
    v5 = dict(LLAMA31_LEGACY)
    del v5["rope_theta"], v5["rope_scaling"]
    v5["rope_parameters"] = {**LLAMA31_LEGACY["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf(v5) == legacy
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling["rope_type"] == "llama3"
    assert legacy.head_dim == 128 and legacy.eos_token_ids == [128001, 128008, 128009]
    assert legacy.context_length == 131072 and not legacy.attention_bias
    assert ModelConfig.from_hf(legacy.to_hf()) == legacy


def test_config_family_flags_and_inference():
    qwen2 = ModelConfig.from_hf({**LLAMA31_LEGACY, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
                                 "use_sliding_window": False, "sliding_window": 4096})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None
    mistral = ModelConfig.from_hf({**LLAMA31_LEGACY, "architectures": None, "model_type": "mistral",
                                   "rope_scaling": None, "sliding_window": 4096, "head_dim": 96})
    assert mistral.architecture == "MistralForCausalLM" and mistral.head_dim == 96
    assert mistral.context_length == 4096  # full attention is exact only within the window
    qwen3 = ModelConfig.from_hf({**LLAMA31_LEGACY, "architectures": ["Qwen3ForCausalLM"], "rope_scaling": None})
    assert qwen3.qk_norm and not qwen3.attention_bias
    legacy_linear = ModelConfig.from_hf({**LLAMA31_LEGACY, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy_linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unknown rope scaling type 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "requires 'low_freq_factor'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": None}, "hidden_size"),
    ({"architectures": ["BertModel"]}, "unsupported model architecture"),
])
def test_bad_configs_are_refused_clearly(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**LLAMA31_LEGACY, **change})
