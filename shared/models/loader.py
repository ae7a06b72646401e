"""load_model: an HF directory or hub id (or `tiny-random`) -> a ready model on the target device.

Tensors stream one at a time from safetensors into parameters already allocated on the device in the
target dtype, so peak host memory is one tensor, never the model.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from shared.models.config import ModelConfig
from shared.models.llama import LlamaForCausalLM
from shared.models.weights import build_empty_model, load_weights
from shared.tokenizer import TINY_RANDOM, resolve_model_dir


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    with open(path) as f:
        return ModelConfig.from_hf(json.load(f))


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a checkpoint: those the shard index names, else model.safetensors, else every
    *.safetensors (Mistral's consolidated.* use other tensor names and are left out)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(f for f in glob.glob(os.path.join(model_dir, "*.safetensors"))
                   if not os.path.basename(f).startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[str], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, with a progress bar on stderr (tensors; the headers give the
    count up front, so the bar has an end)."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc=f"Loading weights ({len(files)} shard{'s' * (len(files) != 1)})",
              unit="tensor", disable=not progress, dynamic_ncols=True) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place (`--load-format dummy`): speed runs of a real shape without a checkpoint.
    Norm weights are ones, the rest small normals, so activations stay finite through every layer."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def load_model(model_path: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               load_format: str = "auto") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Model in eval mode (no grads) and its config. dtype defaults to bf16 on CUDA, fp32 elsewhere.
    load_format "dummy" reads only config.json and fills random weights."""
    dtype = dtype or default_dtype(device)
    if model_path == TINY_RANDOM:
        from shared.models.tiny_random import build_tiny_random_model, tiny_random_config

        return build_tiny_random_model(dtype, device), tiny_random_config()
    model_dir = resolve_model_dir(model_path)
    cfg = load_config(model_dir)
    model = build_empty_model(cfg, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format == "auto":
        load_weights(model, iter_safetensors(safetensors_files(model_dir)))
    else:
        raise ValueError(f"unknown load format {load_format!r} (auto | dummy)")
    return model, cfg
