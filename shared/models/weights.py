"""Where each HF checkpoint tensor lands in our model, and filling a model from (name, tensor) pairs.

The layout is derived from the model itself: every parameter maps to its own name, except the rows of
a MergedLinear, which map to the checkpoint projections it fuses (q/k/v, gate/up). So the set of names a
checkpoint must provide, and the error naming what it lacks, come for free.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from shared.models.config import ModelConfig
from shared.models.layers import Linear, MergedLinear
from shared.models.parallel import Shard

log = logging.getLogger(__name__)

# Checkpoint entries that are derived state, not weights.
# KV cache scales are not weights: an FP8 KV cache reads them apart (quantization.kv_cache_scales).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                     "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")


@dataclass
class WeightSlot:
    """Where one checkpoint tensor goes: rows [row_offset, row_offset + rows) of param, filled from the
    tensor's `shard` (this rank's part under tensor parallelism; None: the whole tensor)."""
    param: nn.Parameter
    row_offset: int
    rows: int
    shard: Shard | None = None

    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = [self.rows, *self.param.shape[1:]]
        if self.shard is not None:
            shape[self.shard.dim] = self.shard.full
        return tuple(shape)

    def fill(self, name: str, source) -> None:
        """source: a tensor, or a safetensors slice (`safe_open(...).get_slice(name)`), of which only this
        rank's shard is read from the file."""
        shape = tuple(source.shape) if torch.is_tensor(source) else tuple(source.get_shape())
        want = self.checkpoint_shape()
        if shape != want:
            raise ValueError(f"weight '{name}' has shape {shape}, the model expects {want}")
        tensor = read_shard(source, self.shard)
        dst = self.param.data[self.row_offset:self.row_offset + self.rows]
        if tensor.shape[0] < self.rows:  # vocabulary padding rows of the last ranks
            dst[tensor.shape[0]:].zero_()
            dst = dst[:tensor.shape[0]]
        dst.copy_(tensor)


def read_shard(source, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a tensor or of a safetensors slice (which reads only those bytes)."""
    if shard is None:
        return source if torch.is_tensor(source) else source[:]
    if torch.is_tensor(source):
        return source.narrow(shard.dim, shard.start, shard.length)
    return source[(slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)]


def checkpoint_layout(model: nn.Module) -> dict[str, WeightSlot]:
    """HF checkpoint name -> where its values go. A tied parameter appears once, under its first name
    (named_parameters() drops the duplicates), so a tied lm_head needs no checkpoint entry."""
    layout: dict[str, WeightSlot] = {}
    for pname, param in model.named_parameters():
        mod_name, leaf = pname.rsplit(".", 1)  # leaf: weight | bias
        module = model.get_submodule(mod_name)
        if isinstance(module, MergedLinear):
            parent = mod_name.rsplit(".", 1)[0]
            for shard in module.shard_names:
                off, rows = module.shard_rows(shard, leaf)
                layout[f"{parent}.{shard}.{leaf}"] = WeightSlot(param, off, rows, module.projection_shard(shard, leaf))
        else:
            leaf_shard = getattr(module, "leaf_shard", None)
            layout[pname] = WeightSlot(param, 0, param.shape[0], leaf_shard(leaf) if leaf_shard else None)
    return layout


def convert_linears_to_fp8(model: nn.Module, fp8_names: set[str] | None,
                           block: tuple[int, int] | None = None) -> set[str] | None:
    """Turn the decoder's linear layers whose checkpoint weights are in `fp8_names` (None: every one, for
    --quantization fp8) into FP8 layers, with one scale per output row or, with `block`, per [bn, bk] block.
    Returns the checkpoint weight names now held in FP8; None (nothing converted) where block scales do not
    tile every such layer (block_aligned) or the kernels do not take the block (bk a power of two >= 16). The
    lm_head stays in the model dtype (logits want the precision; a quantized one is dequantized at load)."""
    chosen = list(_fp8_linears(model, fp8_names))
    if block is not None:
        bk = block[1]
        if bk < 16 or bk & (bk - 1) or not all(module.block_aligned(block) for module, _ in chosen):
            return None
    kept: set[str] = set()
    for module, names in chosen:
        module.to_fp8(block)
        kept.update(names)
    return kept


def _fp8_linears(model: nn.Module, fp8_names: set[str] | None) -> Iterator[tuple[Linear, list[str]]]:
    """The decoder's linear layers whose checkpoint weights are in fp8_names (None: all), with those names."""
    for mod_name, module in model.named_modules():
        if not isinstance(module, Linear) or mod_name == "lm_head":
            continue
        if isinstance(module, MergedLinear):
            parent = mod_name.rsplit(".", 1)[0]
            names = [f"{parent}.{shard}.weight" for shard in module.shard_names]
        else:
            names = [f"{mod_name}.weight"]
        quantized = [n for n in names if fp8_names is None or n in fp8_names]
        if not quantized:
            continue
        if len(quantized) != len(names):
            raise ValueError(f"checkpoint stores {quantized} in fp8 but not {sorted(set(names) - set(quantized))}: "
                             "projections fused into one layer must share a precision")
        yield module, names


def load_weights(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Copy each checkpoint tensor (or this rank's shard of a safetensors slice) into place, converting
    dtype/device on the way; raise if any weight the model needs was not provided. Unknown names are
    skipped with one warning."""
    layout = checkpoint_layout(model)
    # Some tied checkpoints still store lm_head.weight (a copy of the embedding); it is not needed.
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    missing = set(layout)
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            slot = layout.get(name)
            if slot is None:
                if not name.endswith(_IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight"):
                    unknown.append(name)
                continue
            slot.fill(name, tensor)
            missing.discard(name)
    if missing:
        shown = ", ".join(sorted(missing)[:8])
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} required weight(s): {shown}{more}")
    if unknown:
        log.warning("skipped %d checkpoint tensor(s) the model does not use, e.g. %s", len(unknown),
                    ", ".join(unknown[:4]))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model with its parameters allocated (uninitialized) directly on device in dtype."""
    from shared.models.llama import LlamaForCausalLM

    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg)
    return model.eval()
