"""Attention backends (ForwardBatch in, attention out) and the factory that picks one per device.

The Triton kernels they call live in kernels/attention/ and take plain tensors."""
from __future__ import annotations

import torch

from shared.engine.config import ATTENTION_BACKENDS as BACKENDS, unsupported_attention_backend
from shared.models.attention.base import AttentionBackend
from shared.models.attention.torch_backend import TorchAttentionBackend



def create_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                             scaling: float | None = None, device: torch.device | str = "cpu",
                             **kwargs) -> AttentionBackend:
    """"auto" is triton on CUDA and torch elsewhere. Extra kwargs go to the chosen backend."""
    from kernels._utils import triton_usable

    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scaling)
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(f"the triton attention backend needs a CUDA device (got {device}); "
                             "on CPU use 'torch', or set TRITON_INTERPRET=1 to interpret the kernels")
        from shared.models.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scaling, **kwargs)
    raise ValueError(unsupported_attention_backend(name)
                     or f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "TorchAttentionBackend", "create_attention_backend", "BACKENDS"]
