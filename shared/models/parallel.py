"""Tensor parallelism inside the model: which rank this process is, how a checkpoint dimension splits
across ranks, and the two collectives the sharded layers need.

Megatron's split: q/k/v and gate/up are column-parallel (each rank owns some heads / some of the MLP's
intermediate rows), o_proj and down_proj are row-parallel (each rank multiplies its slice of the input
and an all-reduce sums the partial outputs). The embedding and the lm_head split the vocabulary: the
embedding's partial rows are summed by an all-reduce, the lm_head's logit columns are all-gathered, so
every rank ends with the whole hidden state and the whole logits.

The rank is process state, set once by the model runner before the model is built (as in nano-vllm).
With one rank every helper here is the identity and no torch.distributed call is made.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from shared.cache.kv_pool import as_bytes

MAX_TP_SIZE = 8  # one host's GPUs: the all-reduces run over NVLink, never across hosts


class TPConfigError(ValueError):
    """A tensor-parallel degree this model cannot be split by."""


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group; None: the default group


_state = _TPState()


def set_tp(rank: int, size: int, group: object = None) -> None:
    _state.rank, _state.size, _state.group = rank, size, group


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Build full-size (single-rank) modules inside, e.g. to learn a checkpoint's full shapes, or a model of
    rank 0's alone in a tensor-parallel process (STANDALONE's draft, shared/engine/spec/draft.py): layers take
    their shards when built and run collectives only where they hold one, so such a model runs anywhere."""
    saved = (_state.rank, _state.size, _state.group)
    set_tp(0, 1)
    try:
        yield
    finally:
        set_tp(*saved)


# ------------------------------------------------------------------ how dimensions split
@dataclass(frozen=True)
class Shard:
    """This rank's part of one checkpoint tensor: rows [start, start + length) along `dim`, of `full`."""
    dim: int
    start: int
    length: int
    full: int


def in_blocks(shard: Shard, block: int) -> Shard:
    """The same part of a tensor counted in blocks of `block` along its dim (a block-scaled FP8 weight's scales:
    the part starts on a block and covers whole ones, the tensor's last block possibly partial)."""
    assert shard.start % block == 0, f"a shard starting at {shard.start} is not on a block of {block}"
    return Shard(shard.dim, shard.start // block, -(-shard.length // block), -(-shard.full // block))


def even_shard(n: int, dim: int = 0) -> Shard | None:
    """n split evenly (validate_tp checked it divides); None with one rank."""
    if _state.size == 1:
        return None
    per = n // _state.size
    return Shard(dim, _state.rank * per, per, n)


def kv_head_range(num_kv_heads: int, rank: int | None = None) -> tuple[int, int]:
    """(first kv head, kv heads) of this rank (or of `rank`). With fewer kv heads than ranks each kv head
    is replicated on size / num_kv_heads consecutive ranks: exactly the ranks whose q heads use it."""
    size, rank = _state.size, (_state.rank if rank is None else rank)
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank // (size // num_kv_heads), 1


def head_shard(num_heads: int, head_dim: int) -> Shard | None:
    return even_shard(num_heads * head_dim)


def kv_shard(num_kv_heads: int, head_dim: int) -> Shard | None:
    if _state.size == 1:
        return None
    first, n = kv_head_range(num_kv_heads)
    return Shard(0, first * head_dim, n * head_dim, num_kv_heads * head_dim)


def vocab_shard(vocab_size: int) -> tuple[Shard | None, int]:
    """(this rank's checkpoint rows, rows it holds). The vocabulary is padded up to a multiple of the
    rank count, so the last ranks may hold fewer real rows (their padding rows stay zero and their
    logit columns are cut off after the gather)."""
    if _state.size == 1:
        return None, vocab_size
    per = -(-vocab_size // _state.size)
    start = min(_state.rank * per, vocab_size)
    return Shard(0, start, min(per, vocab_size - start), vocab_size), per


def local_heads(num_heads: int) -> int:
    return num_heads // _state.size


def local_kv_heads(num_kv_heads: int) -> int:
    return kv_head_range(num_kv_heads)[1]


def validate_tp(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    if not 1 <= size <= MAX_TP_SIZE:
        raise TPConfigError(f"--tp-size must be between 1 and {MAX_TP_SIZE} (got {size})")
    if num_heads % size:
        raise TPConfigError(f"--tp-size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise TPConfigError(f"--tp-size {size} and the model's {num_kv_heads} kv heads: one must divide the other")
    if intermediate_size % size:
        raise TPConfigError(f"--tp-size {size} does not divide the model's intermediate size {intermediate_size}")


# ------------------------------------------------------------------ collectives
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (NCCL's all-reduce is capturable in a CUDA graph)."""
    if _state.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=_state.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim, in rank order."""
    if _state.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x, group=_state.group)
    return torch.cat(parts, dim=-1)


def all_gather_kv_heads(local: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Every rank's KV of the same positions ([..., its kv heads, head_dim]) -> the model's whole KV
    ([..., num_kv_heads, head_dim]); a replicated head is taken once."""
    if _state.size == 1:
        return local
    import torch.distributed as dist

    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(_state.size)]
    dist.all_gather([as_bytes(p) for p in parts], as_bytes(local), group=_state.group)
    full = local.new_empty((*local.shape[:-2], num_kv_heads, local.shape[-1]))
    for rank, part in enumerate(parts):
        first, n = kv_head_range(num_kv_heads, rank)
        full[..., first:first + n, :] = part
    return full


def local_kv_part(full: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """This rank's kv heads of a whole-model KV buffer ([..., num_kv_heads, head_dim])."""
    if _state.size == 1:
        return full
    first, n = kv_head_range(num_kv_heads)
    return full[..., first:first + n, :].contiguous()


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    if _state.size > 1:
        import torch.distributed as dist

        dist.broadcast(as_bytes(x), src=src, group=_state.group)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's value (the KV pool size all ranks can hold)."""
    if _state.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.group)
    return int(t.item())
