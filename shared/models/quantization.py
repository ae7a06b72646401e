"""Weight quantization a checkpoint declares (`quantization_config`) or the operator asks for.

Honoured: FP8 e4m3 weights with per-tensor, per-channel or block scales, as three families of
checkpoints write them:
- `quant_method: fp8` — per-tensor `weight_scale` (AutoFP8 / vLLM style, `activation_scheme` dynamic
  or static), or `weight_block_size` with `weight_scale_inv` per block (DeepSeek-V3 / Qwen3-FP8 style);
- `quant_method: fbgemm_fp8` — per-channel `weight_scale` [N, 1];
- `quant_method: compressed-tensors` with a `float-quantized` / `naive-quantized` format whose weights
  are 8-bit floats, tensor, channel or block strategy (llm-compressor's FP8_BLOCK: `block_structure`
  [128, 128], `weight_scale` per block).
In every family the stored scale multiplies: real weight = fp8 weight * scale.

Per-tensor and per-channel weights stay FP8 in memory (half the bytes of bf16) and run as FP8 GEMMs
with dynamic per-token activation scales (static `input_scale`s are not needed for that and are
ignored). Block-scaled weights stay FP8 with their block scales where the blocks tile every layer (each
projection's rows and this rank's shard on block boundaries, bk a power of two of at least 16: Qwen3-FP8 and
DeepSeek's [128, 128] on their models) and run as block FP8 GEMMs with activations scaled per token and
group of bk inputs (kernels/fp8_block_gemm.py; one decode row: the GEMV applies the block scales). Where
they do not tile, they are dequantized at load and run in the model dtype: correct, not faster.
Anything else (AWQ, GPTQ, bitsandbytes, int8, 4-bit floats...) is refused at load with a message saying
so: a checkpoint must never load with its scales dropped.

`--quantization fp8` on a bf16/fp32 checkpoint quantizes its linear weights per channel at load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from kernels.reference import FP8_DTYPE, FP8_MAX, dequantize_blocks_ref

log = logging.getLogger(__name__)

SUPPORTED = "fp8 (per-tensor, per-channel or block scales), fbgemm_fp8, compressed-tensors float8 (tensor, channel or block)"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# Checkpoint entries of quantized layers that the FP8 weight path does not need (an FP8 KV cache reads the k/v
# scales apart: kv_cache_scales).
DROPPED_SUFFIXES = (".input_scale", ".activation_scale_ub", ".input_zero_point", ".weight_zero_point",
                    ".k_scale", ".v_scale", ".kv_scale", ".output_scale")


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization cannot be honoured by this engine."""


@dataclass(frozen=True)
class QuantSpec:
    method: str  # the checkpoint's quant_method, or "fp8-online" for --quantization fp8
    block_size: tuple[int, int] | None = None  # set: block scales (kept where they tile the weights)
    keep_blocks: bool = True  # False: block-scaled weights dequantized at load (the engine's default)

    @property
    def online(self) -> bool:
        return self.method == "fp8-online"


def parse_quantization(hf_config: dict[str, Any], requested: str | None = None) -> QuantSpec | None:
    """The spec for a checkpoint's config.json dict (+ the operator's --quantization), None for plain
    weights. Raises UnsupportedQuantization naming what is not supported."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if requested not in (None, "", "none", "fp8"):
        raise UnsupportedQuantization(f"--quantization {requested!r} is not supported (fp8 or none)")
    if not qc:
        return QuantSpec("fp8-online") if requested == "fp8" else None
    if not isinstance(qc, dict):
        raise UnsupportedQuantization("quantization_config must be an object")
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
                    isinstance(b, int) and b > 0 for b in block)):
                raise UnsupportedQuantization(f"fp8 weight_block_size {block!r} is not two positive ints")
            return QuantSpec("fp8", (int(block[0]), int(block[1])))
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise UnsupportedQuantization(f"fp8 activation_scheme {scheme!r} is not supported")
        return QuantSpec("fp8")
    if method == "fbgemm_fp8":
        return QuantSpec("fbgemm_fp8")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise UnsupportedQuantization(
        f"this checkpoint's quantization ({method or 'unnamed'}) is not supported; supported: {SUPPORTED}. "
        "Serve an unquantized (bf16) checkpoint of the model instead")


_CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantSpec:
    fmt = qc.get("format") or qc.get("quantization_format")
    groups = qc.get("config_groups") or {}
    # "mixed-precision": each group names its own format (llm-compressor writes it even when all are fp8).
    formats = ({(g or {}).get("format") for g in groups.values()} if fmt == "mixed-precision" else {fmt})
    if not formats or not formats <= set(_CT_FLOAT_FORMATS):
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} is not supported; supported: "
                                      "float-quantized (fp8 weights)")
    if not groups:
        raise UnsupportedQuantization("compressed-tensors config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnsupportedQuantization(
                f"compressed-tensors group {name!r}: weights {w.get('type')}{w.get('num_bits')} are not "
                "supported (8-bit float only)")
        if w.get("strategy") not in ("tensor", "channel", "block"):
            raise UnsupportedQuantization(
                f"compressed-tensors group {name!r}: weight strategy {w.get('strategy')!r} is not "
                "supported (tensor, channel or block)")
        blocks.add(_block_structure(name, w) if w.get("strategy") == "block" else None)
        act = (group or {}).get("input_activations")
        if act and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise UnsupportedQuantization(f"compressed-tensors group {name!r}: activations "
                                          f"{act.get('type')}{act.get('num_bits')} are not supported")
    if len(blocks) > 1:
        raise UnsupportedQuantization(f"compressed-tensors groups mix weight strategies or block sizes "
                                      f"({sorted(map(str, blocks))}): one per checkpoint is supported")
    return QuantSpec("compressed-tensors", blocks.pop())


def _block_structure(name: str, weights: dict[str, Any]) -> tuple[int, int]:
    """A compressed-tensors block strategy's [bn, bk] (a list, or the older "NxM" string)."""
    block = weights.get("block_structure")
    if isinstance(block, str) and "x" in block:
        block = block.split("x")
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        bn = bk = 0
    if bn <= 0 or bk <= 0:
        raise UnsupportedQuantization(f"compressed-tensors group {name!r}: block_structure {block!r} is not two "
                                      "positive ints")
    return bn, bk


# ------------------------------------------------------------------ checkpoint tensors
def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def per_channel_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A stored per-tensor ([] / [1]) or per-channel ([N] / [N, 1]) scale as float32 [N]."""
    s = scale.to(torch.float32).reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).clone()
    if s.numel() == rows:
        return s
    raise UnsupportedQuantization(f"scale of '{name}' has shape {tuple(scale.shape)}: neither per-tensor nor "
                                  f"per-channel for {rows} rows")


def block_scale(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """A stored block scale of fp8 [N, K] checked to be [ceil(N/bn), ceil(K/bk)], as float32."""
    n, k = w.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise UnsupportedQuantization(f"block scale of '{name}' has shape {tuple(scale.shape)}, expected {want}")
    return scale.to(torch.float32)


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """fp8 [N, K] with one scale per [bn, bk] block ([ceil(N/bn), ceil(K/bk)]) -> float32 [N, K]."""
    return dequantize_blocks_ref(w, block_scale(w, scale, block, name), block, torch.float32)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (blocks tiling it) -> (fp8 [N, K], float32 scale [N / bn, K / bk]) with each
    block's max mapped to FP8_MAX: what block-scaled checkpoints hold."""
    n, k = w.shape
    bn, bk = block
    tiles = w.detach().to(torch.float32).reshape(n // bn, bn, k // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(n, k), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (fp8 [N, K], float32 scale [N]) with each row's max mapped to FP8_MAX."""
    amax = w.detach().abs().amax(dim=1).to(torch.float32).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class CheckpointReader:
    """Random access to a checkpoint's tensors by name across its safetensors shards."""

    def __init__(self, files: list[str]):
        from safetensors import safe_open

        self._handles = [safe_open(p, framework="pt", device="cpu") for p in files]
        self.where: dict[str, Any] = {}
        for h in self._handles:
            for name in h.keys():
                self.where[name] = h

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def dtype_name(self, name: str) -> str:
        return self.where[name].get_slice(name).get_dtype()


def fp8_weight_names(reader: CheckpointReader) -> set[str]:
    """Names of the checkpoint's `*.weight` tensors stored as 8-bit floats."""
    return {n for n in reader.names() if n.endswith(".weight") and reader.dtype_name(n).startswith("F8")}


def quantized_tensors(reader: CheckpointReader, spec: QuantSpec, keep_fp8: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as (name, tensor) pairs the loader places: FP8 weights the model keeps in FP8 come with
    a `<module>.weight_scale` float32 [N]; block-scaled ones come dequantized; scales of other kinds and
    activation scales are consumed here."""
    names = reader.names()
    static = False
    for name in names:
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(DROPPED_SUFFIXES):
            static = static or name.endswith(".input_scale")
            continue
        tensor = reader.get(name)
        if not (name.endswith(".weight") and is_fp8(tensor)):
            yield name, tensor
            continue
        base = name[: -len(".weight")]
        scale_name = next((base + s for s in SCALE_SUFFIXES if base + s in reader.where), None)
        if scale_name is None:
            raise UnsupportedQuantization(f"fp8 weight '{name}' has no weight_scale / weight_scale_inv")
        scale = reader.get(scale_name)
        if spec.block_size is not None and name in keep_fp8:
            yield name, tensor.to(FP8_DTYPE)
            yield base + ".weight_scale", block_scale(tensor, scale, spec.block_size, scale_name)
        elif spec.block_size is not None:
            yield name, dequantize_blocks(tensor, scale, spec.block_size, name)
        elif name in keep_fp8:
            yield name, tensor.to(FP8_DTYPE)
            yield base + ".weight_scale", per_channel_scale(scale, tensor.shape[0], scale_name)
        else:
            yield name, tensor.to(torch.float32) * per_channel_scale(scale, tensor.shape[0], scale_name)[:, None]
    if static:
        log.info("fp8 checkpoint with static activation scales: activations are scaled per token instead")


def online_quantized(weights: Iterable[tuple[str, torch.Tensor]], keep_fp8: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """--quantization fp8 on a float checkpoint: the linear weights the model keeps in FP8, quantized per channel."""
    for name, tensor in weights:
        if name in keep_fp8 and not is_fp8(tensor):
            q, scale = quantize_per_channel(tensor)
            yield name, q
            yield name[: -len(".weight")] + ".weight_scale", scale
        else:
            yield name, tensor


# ------------------------------------------------------------------ KV cache scales
# Per-layer scales an FP8 KV cache stores k / k_scale and v / v_scale with, as checkpoints calibrated for one write
# them: `self_attn.k_scale` / `v_scale` (vLLM, ModelOpt, compressed-tensors), one `self_attn.kv_scale` for both
# (AutoFP8), or `self_attn.k_proj.output_scale` / `v_proj.output_scale` (older compressed-tensors).
_KV_SCALE_NAMES = ((".self_attn.k_scale", ".self_attn.v_scale"), (".self_attn.kv_scale", ".self_attn.kv_scale"),
                   (".self_attn.k_proj.output_scale", ".self_attn.v_proj.output_scale"))


def kv_cache_scales(reader: CheckpointReader, num_layers: int) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) of every layer from the checkpoint, or None where it has none. A checkpoint with scales
    for some layers only, or a scale that is not one positive finite number, is refused."""
    names = set(reader.names())
    for k_suffix, v_suffix in _KV_SCALE_NAMES:
        found = [(f"model.layers.{i}{k_suffix}", f"model.layers.{i}{v_suffix}") for i in range(num_layers)]
        have = [k in names and v in names for k, v in found]
        if not any(have):
            continue
        if not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            raise UnsupportedQuantization(f"the checkpoint has KV cache scales ({k_suffix[1:]}) for some layers "
                                          f"but not for layers {missing[:8]}")
        scales = []
        for k_name, v_name in found:
            pair = []
            for name in (k_name, v_name):
                t = reader.get(name).to(torch.float32).reshape(-1)
                if t.numel() != 1 or not bool(torch.isfinite(t).all()) or float(t) <= 0:
                    raise UnsupportedQuantization(f"KV cache scale '{name}' must be one positive number, got "
                                                  f"shape {tuple(t.shape)}")
                pair.append(float(t))
            scales.append((pair[0], pair[1]))
        return scales
    return None
