"""Building blocks of the Llama family. Each numeric op sits behind one function, so a fused GPU kernel
can replace it in one place.

Parameters are created with torch.empty: the loader (or tiny_random) fills every one, and skipping the
init keeps building an 8B model on its target device as cheap as the allocation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops


# ------------------------------------------------------------------ ops
# The numeric ops live in kernels.ops, which runs Triton kernels on CUDA and the torch references
# elsewhere; the parity tests against transformers therefore cover the references too.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, H] -> x / rms(x) * weight, computed in fp32."""
    return ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next norm in one op. On CUDA
    `residual` is updated in place; use the returned one."""
    return ops.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] holding gate then up. Returns silu(gate) * up: [T, I]."""
    return ops.silu_and_mul(x)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


# ------------------------------------------------------------------ modules
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normalized, new residual). Without a residual, x itself becomes the residual stream."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by to_fp8()

    def to_fp8(self) -> None:
        """Hold the weight as FP8 e4m3 with one float32 dequantization scale per output row; the loader
        fills both (`<name>.weight`, `<name>.weight_scale`)."""
        out_features, in_features = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.weight_scale)


class MergedLinear(Linear):
    """Several checkpoint projections of the same input stacked along the output dim, run as one GEMM.

    `shard_names[i]` is the checkpoint module name whose rows fill `output_sizes[i]` rows, in order; the
    loader uses them to place each checkpoint tensor."""

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        assert len(output_sizes) == len(shard_names)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)

    def shard_rows(self, shard_name: str) -> tuple[int, int]:
        """(row offset, rows) of one checkpoint projection inside the fused weight."""
        i = self.shard_names.index(shard_name)
        return sum(self.output_sizes[:i]), self.output_sizes[i]


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
