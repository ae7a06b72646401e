"""Attention backends (ForwardBatch in, attention out) and the factory that picks one per device.

The Triton kernels they call live in kernels/attention/ and take plain tensors."""
from __future__ import annotations

import torch

from shared.engine.config import ATTENTION_BACKENDS as BACKENDS, attention_backend_error
from shared.models.attention.base import AttentionBackend
from shared.models.attention.torch_backend import TorchAttentionBackend



def create_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                             scaling: float | None = None, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.bfloat16, **kwargs) -> AttentionBackend:
    """"auto" is triton on CUDA and torch elsewhere. Extra kwargs go to the triton backend; dtype (the model's) to
    flashinfer's, which is imported only here, when chosen."""
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
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device (got {device}); on CPU use 'torch'")
        from shared.models.attention.flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, scaling, device=device, dtype=dtype)
    raise ValueError(attention_backend_error(name) or f"attention backend {name!r} has no implementation here")


__all__ = ["AttentionBackend", "TorchAttentionBackend", "create_attention_backend", "BACKENDS"]
