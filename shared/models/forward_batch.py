"""What one forward pass needs to know about its batch, in the layout the attention kernels read.

Tokens of all requests are packed along one axis (T). Request i owns tokens
[extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i]); its full context (cached prefix +
new tokens) is req_to_token[req_pool_indices[i], :seq_lens[i]].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kernels.h2d import to_device

if TYPE_CHECKING:
    from shared.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens over a (possibly empty) cached prefix
    DECODE = "decode"  # exactly one new token per request


class BatchAttention(Protocol):
    """What a model layer calls on its batch's attention backend (every AttentionBackend of
    shared/models/attention/ is one): q, k, v of this pass's tokens in, attention out."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, rotary=None) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32: context length after this pass
    extend_prefix_lens: torch.Tensor  # [B] int32: tokens already in the KV pool
    extend_seq_lens: torch.Tensor  # [B] int32: new tokens in this pass
    extend_start_loc: torch.Tensor  # [B] int32: offset of request i's tokens in the packed axis
    out_cache_loc: torch.Tensor  # [T] int64: pool slots the new tokens' K/V are written to
    req_to_token: torch.Tensor  # [max_reqs + 1, max_context_len] int32
    kv_pool: "KVPool"
    attn_backend: BatchAttention
    # Host copies, for backends and loops that must not sync with the device.
    seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    req_pool_indices_cpu: list[int] | None = None
    # Decode: (shared prefix length, batch indices) of requests whose KV begins with the same slots; the
    # backend may attend each such prefix once per group (shared-prefix attention).
    prefix_groups: list[tuple[int, list[int]]] | None = None
    # Decode captured with shared-prefix attention: the groups are in the backend's static buffers for
    # this batch size (AttentionBackend.load_graph_cascade), not in prefix_groups.
    graph_cascade: bool = False
    # Extend: a host bound on every request's new-token count wider than this batch's own (a captured
    # graph's, shared/engine/extend_graph.py); None: the batch's longest (extend_seq_lens_cpu).
    max_extend_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], req_pool_indices: list[int],
              prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor,
              req_to_token: torch.Tensor, kv_pool: "KVPool", attn_backend: BatchAttention,
              device: torch.device) -> "ForwardBatch":
        """Assemble a batch from host lists (one transfer per tensor)."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        ext = np.array(extend_lens, dtype=np.int64)
        starts = np.cumsum(ext) - ext
        # Token j of request i sits at prefix_lens[i] + j (in numpy: an 8k-token pass built this list in
        # ~0.4 ms of Python before its first kernel).
        positions = np.arange(int(ext.sum()), dtype=np.int64) + np.repeat(np.array(prefix_lens, dtype=np.int64) - starts, ext)

        def t(x, dtype):
            return to_device(x, dtype, device)

        return cls(
            mode=mode, batch_size=len(extend_lens),
            input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
            req_pool_indices=t(req_pool_indices, torch.int64), seq_lens=t(seq_lens, torch.int32),
            extend_prefix_lens=t(prefix_lens, torch.int32), extend_seq_lens=t(extend_lens, torch.int32),
            extend_start_loc=t(starts, torch.int32), out_cache_loc=to_device(out_cache_loc, torch.int64, device),
            req_to_token=req_to_token, kv_pool=kv_pool, attn_backend=attn_backend,
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(extend_lens),
            req_pool_indices_cpu=list(req_pool_indices),
        )
