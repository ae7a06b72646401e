"""Preallocated KV memory: one K and one V buffer per layer, indexed by token slot.

Slot indices are global ints. Page 0 (slots 0..page_size-1) is never handed out: slot 0 is the padding
target for dummy tokens (CUDA-graph padding), so writes there are harmless.

The buffers hold the model's dtype, or FP8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2: half the bytes, twice the
tokens). An FP8 pool stores k / k_scale and v / v_scale with one scale per layer (1.0 unless the checkpoint
calibrated them); every reader multiplies them back in.
"""
from __future__ import annotations

import torch

from kernels.h2d import to_device


# --kv-cache-dtype values other than auto (the model's dtype); "fp8" is vLLM's name for e4m3.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor (an FP8 pool's buffers and pages) as its bytes, for indexing, copies and collectives: every torch
    build and collective backend handles uint8 on every device, not every one float8. Any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for --kv-cache-dtype `name`."""
    if name in ("auto", "", None):
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported: auto, {', '.join(FP8_KV_DTYPES)}")
    return FP8_KV_DTYPES[name]


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: torch.dtype, device: torch.device | str,
                 scales: list[tuple[float, float]] | None = None):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.num_pages = num_pages  # usable pages, excluding the reserved page 0
        self.size = (num_pages + 1) * page_size  # total slots including the reserved page
        self.dtype = dtype
        self.device = torch.device(device)
        # One allocation, [K0, V0, K1, V1, ...]: the per-layer buffers are views of it, so a copy of some slots of
        # every layer (the host tier's, shared/cache/host_pool.py) is one indexing kernel, not one per buffer.
        self.kv_buffer = torch.zeros((2 * num_layers, self.size, num_kv_heads, head_dim), dtype=dtype,
                                     device=self.device)
        self.k_buffers = [self.kv_buffer[2 * layer] for layer in range(num_layers)]
        self.v_buffers = [self.kv_buffer[2 * layer + 1] for layer in range(num_layers)]
        # (k_scale, v_scale) of each layer: what an FP8 pool's rows are multiplied by when read.
        if scales is not None and dtype.itemsize != 1 and any(s != (1.0, 1.0) for s in scales):
            raise ValueError("KV scales apply to an FP8 pool only")
        self.scales = [(float(k), float(v)) for k, v in scales] if scales is not None else [(1.0, 1.0)] * num_layers
        assert len(self.scales) == num_layers

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens. k, v: [T, num_kv_heads, head_dim] (strided views are fine);
        loc: [T] slot ids. One fused kernel on the GPU (decode is launch-bound)."""
        from kernels import ops

        ops.store_kv(self.k_buffers[layer], self.v_buffers[layer], loc, k, v, *self.scales[layer])

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]


class ReqToTokenPool:
    """Row r holds the slot ids of the tokens of the request that owns row r, in position order."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        # Row 0 is reserved for padding (CUDA-graph dummy requests); it stays all zeros.
        self.req_to_token = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int32, device=device)
        self._free = list(range(max_reqs, 0, -1))
        self._is_free = [False] + [True] * max_reqs  # by row: the double-free check in O(1)
        # Called after every write (row, start, slots): tensor parallelism mirrors the table on every rank.
        self.on_write = None

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        assert 0 < row <= self.max_reqs and not self._is_free[row], f"bad req row free {row}"
        self._is_free[row] = True
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """`slots` on the host (staged through pinned memory and copied without blocking: a pageable copy
        would wait for all the work queued on the stream, the pass in flight included) or on the device."""
        dev = self.req_to_token.device
        values = to_device(slots, torch.int32, dev) if slots.device != dev else slots.to(torch.int32)
        self.req_to_token[row, start:start + len(slots)] = values
        if self.on_write is not None:
            self.on_write(row, start, slots)
