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
from kernels.residual_norm import ResidualNorm
from kernels.rope_store import RopeStore
from shared.models.parallel import Shard, all_reduce, even_shard, in_blocks, vocab_shard


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
    """y = x W^T (+ b). Under tensor parallelism (shared/models/parallel.py) `parallel` says how W splits:
    "column": this rank owns some output rows; "row": some input columns, the partial outputs summed by
    an all-reduce (the bias added once, after it); "vocab": output rows padded to a multiple of the rank
    count (the untied lm_head, whose logits the model gathers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None):
        super().__init__()
        self.parallel = parallel
        shard: Shard | None = None
        rows, cols = out_features, in_features
        if parallel == "column":
            shard = even_shard(out_features)
        elif parallel == "row":
            shard = even_shard(in_features, dim=1)
        elif parallel == "vocab":
            shard, rows = vocab_shard(out_features)
        if shard is not None and parallel != "vocab":
            rows, cols = (shard.length, cols) if shard.dim == 0 else (rows, shard.length)
        self.shard = shard
        self.weight = _param(rows, cols)
        self.bias = _param(rows) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by to_fp8()
        self.weight_block: tuple[int, int] | None = None  # (bn, bk) of block scales, set by to_fp8()

    def leaf_shard(self, leaf: str) -> Shard | None:
        """How the checkpoint tensor `<name>.<leaf>` splits on this rank (None: this rank holds it whole).
        A row-parallel layer's bias and per-output-row scales are whole on every rank; block scales split as
        the weight does, in blocks."""
        if leaf == "weight_scale" and self.weight_block is not None:
            return self.shard and in_blocks(self.shard, self.weight_block[self.shard.dim])
        if self.shard is None or (self.shard.dim == 1 and leaf != "weight"):
            return None
        return self.shard

    def block_aligned(self, block: tuple[int, int]) -> bool:
        """Whether [bn, bk] blocks tile this rank's weight exactly: its rows and columns, and where its shard
        starts (block scales then split and stack with it)."""
        rows, cols = self.weight.shape
        shard_ok = self.shard is None or self.shard.start % block[self.shard.dim] == 0
        return rows % block[0] == 0 and cols % block[1] == 0 and shard_ok

    def to_fp8(self, block: tuple[int, int] | None = None) -> None:
        """Hold the weight as FP8 e4m3 with float32 dequantization scales: one per output row, or with `block`
        one per [bn, bk] block (which must tile the weight: block_aligned); the loader fills both
        (`<name>.weight`, `<name>.weight_scale`)."""
        out_features, in_features = self.weight.shape
        device = self.weight.device
        assert block is None or self.block_aligned(block)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                               device=device), requires_grad=False)
        shape = (out_features,) if block is None else (out_features // block[0], in_features // block[1])
        self.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
        self.weight_block = block

    def forward(self, x: torch.Tensor, gated: bool = False, norm_in: ResidualNorm | None = None,
                add_norm: ResidualNorm | None = None, rope: RopeStore | None = None,
                gated_out: bool = False) -> torch.Tensor:
        """gated: x is a gated MLP's [T, 2 * in_features] (gate | up) and the layer's input is
        silu(gate) * up, computed inside the decode GEMV where ops can (silu_mul_linear).
        norm_in / add_norm: one row; this layer consumes or produces a residual RMSNorm split around it
        (kernels/residual_norm.py; not under tensor parallelism).
        rope: one decode row of a qkv projection; rope and the KV store run in the GEMV's epilogue
        (kernels/rope_store.py).
        gated_out: this layer is a gated MLP's gate | up projection and returns silu(gate) * up, in the decode
        GEMV's epilogue where ops can (gated_linear); under tensor parallelism each rank gates its own rows."""
        epilogue = norm_in is not None or add_norm is not None or rope is not None
        if epilogue:
            assert self.shard is None, "split norms and rope in the epilogue run without tensor parallelism"
        if gated_out:
            assert not gated and add_norm is None and rope is None and self.parallel != "row", \
                "gated_out: a column-parallel gate | up projection, no producer epilogue"
            return ops.gated_linear(x, self.weight, self.bias, self.weight_scale, norm_in=norm_in)
        if epilogue:
            if gated:
                assert norm_in is None and rope is None, "a gated input is not a norm's output"
                return ops.silu_mul_linear(x, self.weight, self.bias, self.weight_scale, add_norm=add_norm)
            return ops.linear(x, self.weight, self.bias, self.weight_scale, norm_in=norm_in, add_norm=add_norm,
                              rope=rope)
        matmul = ops.silu_mul_linear if gated else ops.linear
        if self.parallel == "row" and self.shard is not None:
            y = all_reduce(matmul(x, self.weight, None, self.weight_scale))
            return y if self.bias is None else y + self.bias
        return matmul(x, self.weight, self.bias, self.weight_scale)


class MergedLinear(Linear):
    """Several checkpoint projections of the same input stacked along the output dim, run as one GEMM.

    `shard_names[i]` is the checkpoint module name whose rows fill `output_sizes[i]` rows, in order; the
    loader uses them to place each checkpoint tensor. Under tensor parallelism `shards[i]` is this rank's
    part of projection i (column-parallel; k/v may be replicated, so the parts need not be even)."""

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool = False,
                 shards: list[Shard | None] | None = None):
        shards = shards or [None] * len(output_sizes)
        assert len(output_sizes) == len(shard_names) == len(shards)
        local = [s.length if s is not None else n for s, n in zip(shards, output_sizes)]
        super().__init__(in_features, sum(local), bias)
        self.output_sizes = local
        self.shard_names = list(shard_names)
        self.shards = list(shards)

    def shard_rows(self, shard_name: str, leaf: str = "weight") -> tuple[int, int]:
        """(row offset, rows) of one checkpoint projection inside the fused weight (of its block scales' rows
        for leaf "weight_scale" with block scales)."""
        i = self.shard_names.index(shard_name)
        offset, rows = sum(self.output_sizes[:i]), self.output_sizes[i]
        if leaf == "weight_scale" and self.weight_block is not None:
            return offset // self.weight_block[0], rows // self.weight_block[0]
        return offset, rows

    def projection_shard(self, shard_name: str, leaf: str = "weight") -> Shard | None:
        """This rank's rows of the checkpoint projection (every leaf: weight, bias, scales; block scales in
        blocks)."""
        shard = self.shards[self.shard_names.index(shard_name)]
        if shard is not None and leaf == "weight_scale" and self.weight_block is not None:
            return in_blocks(shard, self.weight_block[0])
        return shard

    def block_aligned(self, block: tuple[int, int]) -> bool:
        """Linear's, and every projection's rows and this rank's part of it start on a block."""
        return super().block_aligned(block) and all(
            n % block[0] == 0 and (s is None or s.start % block[0] == 0) for n, s in zip(self.output_sizes, self.shards))


class Embedding(nn.Module):
    """With `parallel`, each rank holds a contiguous block of the (padded) vocabulary; a token outside
    the block embeds to zeros there and the all-reduce fills in the owner's row."""

    def __init__(self, num_embeddings: int, dim: int, parallel: bool = False):
        super().__init__()
        self.shard, rows = vocab_shard(num_embeddings) if parallel else (None, num_embeddings)
        self.weight = _param(rows, dim)

    def leaf_shard(self, leaf: str) -> Shard | None:
        return self.shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        local = ids - self.shard.start
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))
