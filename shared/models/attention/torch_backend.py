"""Attention over the paged pool in plain torch (kernels/reference.py's functions): the CPU path."""
from __future__ import annotations

import torch

from kernels.reference import cascade_decode_attention_ref, paged_attention_ref
from shared.models.forward_batch import ForwardBatch
from shared.models.attention.base import AttentionBackend


class TorchAttentionBackend(AttentionBackend):
    supports_cascade = True

    def forward_extend(self, q, k, v, layer_id, fb: ForwardBatch):
        k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
        k_scale, v_scale = fb.kv_pool.scales[layer_id]
        out = torch.empty_like(q)
        start = 0
        for i in range(fb.batch_size):
            n = fb.extend_seq_lens_cpu[i]
            seq_len = fb.seq_lens_cpu[i]
            slots = fb.req_to_token[fb.req_pool_indices[i], :seq_len].long()
            # The new tokens' own k, v as computed (the Triton kernel's reading; an FP8 pool rounds them).
            new_kv = (k[start:start + n].view(n, -1, self.head_dim), v[start:start + n].view(n, -1, self.head_dim)) \
                if k is not None else None
            out[start:start + n] = paged_attention_ref(
                q[start:start + n], k_buf, v_buf, slots, fb.extend_prefix_lens_cpu[i], self.scaling, k_scale, v_scale,
                new_kv)
            start += n
        return out

    def forward_decode(self, q, layer_id, fb: ForwardBatch):
        if fb.prefix_groups:
            k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
            return cascade_decode_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices,
                                                fb.seq_lens, fb.prefix_groups, self.scaling,
                                                *fb.kv_pool.scales[layer_id])
        return self.forward_extend(q, None, None, layer_id, fb)
