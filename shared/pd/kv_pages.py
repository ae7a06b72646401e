"""KV of a run of token positions as one contiguous buffer, token-major: [tokens, layers, 2, heads, dim].

Token-major so that any suffix of a gathered run is itself contiguous (the decode side asks for the
positions its tree lacks), and one transfer is one message. Both sides run these on their engine thread,
so pool reads and writes are ordered with the forward passes on the same stream.
"""
from __future__ import annotations

import torch

from shared.cache.kv_pool import KVPool, as_bytes
from kernels.h2d import to_device


def token_layout(pool: KVPool) -> list[int]:
    return [pool.num_layers, 2, pool.num_kv_heads, pool.head_dim]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def gather(pool: KVPool, slots: torch.Tensor, staging: str = "device") -> torch.Tensor:
    """KV at `slots` (one slot per position) -> a new contiguous buffer. `staging="host"` returns it in
    pinned host memory, for transports that cannot read device memory. Never waits for the GPU: the
    slot indices go up through pinned memory (a pageable copy would queue behind the running pass and
    stall the engine thread until it ends)."""
    loc = to_device(slots, torch.int64, pool.device)
    out = torch.empty((len(slots), pool.num_layers, 2, pool.num_kv_heads, pool.head_dim),
                      dtype=pool.dtype, device=pool.device)
    raw = as_bytes(out)
    for layer in range(pool.num_layers):
        k, v = pool.get_kv(layer)
        raw[:, layer, 0].copy_(as_bytes(k)[loc])
        raw[:, layer, 1].copy_(as_bytes(v)[loc])
    return staged(out, staging)


def staged(buf: torch.Tensor, staging: str) -> torch.Tensor:
    """`buf` where the transport reads it: as is, or (staging "host", a GPU buffer) copied to pinned
    host memory without waiting (the caller waits on an event before reading it)."""
    if staging == "host" and buf.device.type == "cuda":
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        host.copy_(buf, non_blocking=True)
        return host
    return buf


def scatter(pool: KVPool, slots: torch.Tensor, buf: torch.Tensor) -> None:
    """Write a gathered buffer into the pool at `slots` (the receiving side's own slots)."""
    if buf.shape != (len(slots), pool.num_layers, 2, pool.num_kv_heads, pool.head_dim):
        raise ValueError(f"KV buffer of shape {tuple(buf.shape)} does not fit {len(slots)} slots of this pool")
    if buf.dtype != pool.dtype:
        raise ValueError(f"KV buffer of {dtype_name(buf.dtype)} does not fit this pool of {dtype_name(pool.dtype)}")
    buf = buf.to(pool.device, non_blocking=True)
    loc = to_device(slots, torch.int64, pool.device)  # (pinned: no wait for the step in flight)
    raw = as_bytes(buf)
    for layer in range(pool.num_layers):
        k, v = pool.get_kv(layer)
        as_bytes(k)[loc] = raw[:, layer, 0]
        as_bytes(v)[loc] = raw[:, layer, 1]


def empty_buffer(layout: list[int], dtype: torch.dtype, device: torch.device, tokens: int,
                 staging: str = "device") -> torch.Tensor:
    """Where a receiver puts `tokens` positions of KV of this per-token `layout`."""
    shape = (tokens, *layout)
    if staging == "host" and device.type == "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype, device=device)


def queued_work(buf: torch.Tensor):
    """An event after the work queued so far on the stream of `buf`'s GPU (None off the GPU), for a receive
    buffer fresh from the caching allocator: its memory may be that of tensors freed while their kernels are
    still queued. The allocator's reuse is ordered on the stream, UCX's writes are not: a receive waits for
    this event before UCX may write, or those kernels and the pages would overwrite each other."""
    if buf.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(buf.device))  # (the caller's thread may have another current GPU)
    return event


def as_transport_buffer(t: torch.Tensor):
    """What UCX can read/write: the tensor on the GPU (__cuda_array_interface__; an FP8 one as its bytes, as
    torch describes no float8 type there), a byte view of its storage on the host (the buffer protocol;
    torch tensors do not export it themselves)."""
    if t.device.type == "cuda":
        return as_bytes(t)
    return t.view(-1).view(torch.uint8).numpy()
