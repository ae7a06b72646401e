"""load_model: an HF directory or hub id (or `tiny-random`) -> a ready model on the target device.

Tensors stream one at a time from safetensors into parameters already allocated on the device in the
target dtype, so peak host memory is one tensor, never the model.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from shared.models.config import ModelConfig
from shared.models.llama import LlamaForCausalLM
from shared.models.parallel import tp_rank
from shared.models.quantization import (CheckpointReader, QuantSpec, fp8_weight_names, kv_cache_scales,
                                        online_quantized, parse_quantization, quantize_blocks, quantize_per_channel,
                                        quantized_tensors)
from shared.models.weights import build_empty_model, convert_linears_to_fp8, load_weights
from shared.tokenizer import TINY_RANDOM, resolve_model_dir

log = logging.getLogger(__name__)


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    with open(path) as f:
        return json.load(f)


def load_config(model_dir: str) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(model_dir))


def load_config_of(model_path: str) -> ModelConfig:
    """The config of what load_model(model_path) would load, without its weights."""
    if model_path == TINY_RANDOM:
        from shared.models.tiny_random import tiny_random_config

        return tiny_random_config()
    return load_config(resolve_model_dir(model_path))


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


def iter_safetensors(files: list[str], progress: bool = True,
                     lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, with a progress bar on stderr (tensors; the headers give the
    count up front, so the bar has an end). lazy: yield safetensors slices instead, from which the
    loader reads only this rank's shard (tensor parallelism)."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc=f"Loading weights ({len(files)} shard{'s' * (len(files) != 1)})",
              unit="tensor", disable=not progress, dynamic_ncols=True) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
                    bar.update(1)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place (`--load-format dummy`): speed runs of a real shape without a checkpoint.
    Norm weights are ones, the rest small normals, so activations stay finite through every layer."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("weight_scale"):
                continue
            if param.dtype == torch.float8_e4m3fn:  # quantize a float draw, scales alongside
                draw = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(
                    0.0, 0.02, generator=gen)
                block = model.get_submodule(name.rsplit(".", 1)[0]).weight_block
                q, scale = quantize_per_channel(draw) if block is None else quantize_blocks(draw, block)
                param.copy_(q)
                model.get_parameter(name[: -len("weight")] + "weight_scale").copy_(scale)
            else:
                param.normal_(0.0, 0.02, generator=gen)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)


def load_model(model_path: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               load_format: str = "auto", quantization: str | None = None,
               keep_fp8_blocks: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Model in eval mode (no grads) and its config. dtype defaults to bf16 on CUDA, fp32 elsewhere.
    load_format "dummy" reads only config.json and fills random weights. A checkpoint's
    quantization_config is honoured or refused (shared/models/quantization.py); `quantization="fp8"`
    quantizes a float checkpoint's linear weights at load. keep_fp8_blocks=False: block-scaled FP8 weights are
    dequantized at load even where their blocks tile the layers (the engine's default; --fp8-block-kernels keeps
    them)."""
    dtype = dtype or default_dtype(device)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load format {load_format!r} (auto | dummy)")
    if model_path == TINY_RANDOM:
        from shared.models.tiny_random import build_tiny_random_model, tiny_random_config

        parse_quantization({}, quantization)  # refuses unknown values
        model = build_tiny_random_model(dtype, device)
        if quantization == "fp8":
            _quantize_in_place(model)
        return model, tiny_random_config()
    model_dir = resolve_model_dir(model_path)
    hf_config = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_config)
    spec = parse_quantization(hf_config, quantization)  # before any allocation: refusals are cheap
    if spec is not None and spec.block_size is not None and not keep_fp8_blocks:
        spec = dataclasses.replace(spec, keep_blocks=False)
    model = build_empty_model(cfg, dtype, device)
    if load_format == "dummy":
        if spec is not None and spec.keep_blocks:
            convert_linears_to_fp8(model, None, spec.block_size)
        init_dummy_weights(model)
    else:
        _load_checkpoint(model, safetensors_files(model_dir), spec)
    return model, cfg


def load_kv_scales(model_path: str, num_layers: int, load_format: str = "auto") -> list[tuple[float, float]] | None:
    """The checkpoint's per-layer (k_scale, v_scale) for an FP8 KV cache, or None where it has none (then every
    scale is 1.0). Read only when the engine runs an FP8 cache; a bf16 cache needs none."""
    if model_path == TINY_RANDOM or load_format == "dummy":
        return None
    return kv_cache_scales(CheckpointReader(safetensors_files(resolve_model_dir(model_path))), num_layers)


def _load_checkpoint(model: LlamaForCausalLM, files: list[str], spec: QuantSpec | None) -> None:
    if spec is None:
        load_weights(model, iter_safetensors(files, progress=tp_rank() == 0, lazy=True))
    elif spec.online:
        kept = convert_linears_to_fp8(model, None)
        load_weights(model, online_quantized(iter_safetensors(files, progress=tp_rank() == 0), kept))
    else:
        reader = CheckpointReader(files)
        fp8_names = fp8_weight_names(reader)
        if not fp8_names:
            raise ValueError(f"quantization_config says {spec.method} but no weight is stored as fp8")
        kept = convert_linears_to_fp8(model, fp8_names, spec.block_size) if spec.keep_blocks else set()
        if kept is None:
            log.warning("fp8 blocks %s do not tile every layer of this model (or its tensor-parallel shards): "
                        "the weights are dequantized at load and run in the model dtype", list(spec.block_size))
            kept = set()
        load_weights(model, quantized_tensors(reader, spec, kept))


def _quantize_in_place(model: LlamaForCausalLM) -> None:
    """--quantization fp8 on weights already in memory (the tiny-random model): per output row, which for
    a fused layer is the same as per projection."""
    from shared.models.layers import Linear

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                q, scale = quantize_per_channel(module.weight.detach())
                module.to_fp8()
                module.weight.copy_(q)
                module.weight_scale.copy_(scale)
