"""Attention backends and the factory that picks one per device."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("torch", "triton", "flashinfer", "auto")


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
        from kernels.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scaling, **kwargs)
    if name == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise ValueError("attention backend 'flashinfer' needs the flashinfer package, which is not "
                             "installed; use 'triton' or 'auto'") from e
        try:
            from kernels.attention.flashinfer_backend import FlashInferAttentionBackend
        except ImportError as e:
            raise ValueError("flashinfer is installed but this project has no FlashInfer backend yet; "
                             "use 'triton' or 'auto'") from e
        return FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, scaling, **kwargs)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")


__all__ = ["AttentionBackend", "TorchAttentionBackend", "create_attention_backend", "BACKENDS"]
