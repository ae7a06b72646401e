"""`tiny-random`: a small Llama with deterministic random weights, paired with the tiny tokenizer.

Weights are drawn on CPU in fp32 from one seeded generator in a fixed (sorted-name) order, as an HF
state dict, so the in-memory model and the one saved to disk are the same on every machine.
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from shared.models.config import ModelConfig
from shared.models.llama import LlamaForCausalLM
from shared.models.parallel import unsharded
from shared.models.weights import build_empty_model, checkpoint_layout, load_weights
from shared.tokenizer import save_tiny_tokenizer

SEED = 1234
TINY_EOS_ID = 2  # <|im_end|> in the tiny tokenizer


def tiny_random_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        bos_token_id=None, eos_token_ids=[TINY_EOS_ID], torch_dtype="float32")


def tiny_random_state_dict(cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights. Projections use std 1/sqrt(fan_in) rather than HF's 0.02: at 0.02 a
    64-wide model's attention is uniform and its logits nearly flat, so greedy output would say little."""
    cfg = cfg or tiny_random_config()
    with torch.device("meta"), unsharded():  # the checkpoint's full shapes, whatever this rank holds
        shapes = {name: (slot.rows, *slot.param.shape[1:])
                  for name, slot in checkpoint_layout(LlamaForCausalLM(cfg)).items()}
    gen = torch.Generator().manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:
            gain = 4.0 if name == "lm_head.weight" else 1.0  # logits spread over a few units
            out[name] = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[-1]))
    return out


def build_tiny_random_model(dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu") -> LlamaForCausalLM:
    cfg = tiny_random_config()
    model = build_empty_model(cfg, dtype, device)
    load_weights(model, tiny_random_state_dict(cfg).items())
    return model


def save_tiny_random_checkpoint(path: str) -> None:
    """An HF directory (config.json, model.safetensors, tokenizer files) holding the tiny-random model."""
    os.makedirs(path, exist_ok=True)
    cfg = tiny_random_config()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    save_file(tiny_random_state_dict(cfg), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(path)
