"""Reference attention over the paged pool in plain torch: the CPU path and the kernels' oracle."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend
from shared.engine.forward_batch import ForwardBatch


def paged_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                        prefix_len: int, scaling: float) -> torch.Tensor:
    """q: [n, Hq, D] new tokens at positions prefix_len..prefix_len+n-1; slots: [prefix_len + n] pool
    slots of the whole context. Causal. Returns [n, Hq, D] in q's dtype (computed in fp32)."""
    n, hq, d = q.shape
    k = k_buf[slots].float()  # [L, Hkv, D]
    v = v_buf[slots].float()
    group = hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scaling
    L = k.shape[0]
    qpos = torch.arange(prefix_len, prefix_len + n, device=q.device).unsqueeze(1)
    kpos = torch.arange(L, device=q.device).unsqueeze(0)
    scores = scores.masked_fill((kpos > qpos).unsqueeze(0), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    supports_cascade = True

    def forward_extend(self, q, k, v, layer_id, fb: ForwardBatch):
        k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
        out = torch.empty_like(q)
        start = 0
        for i in range(fb.batch_size):
            n = fb.extend_seq_lens_cpu[i]
            seq_len = fb.seq_lens_cpu[i]
            slots = fb.req_to_token[fb.req_pool_indices[i], :seq_len].long()
            out[start:start + n] = paged_attention_ref(
                q[start:start + n], k_buf, v_buf, slots, fb.extend_prefix_lens_cpu[i], self.scaling)
            start += n
        return out

    def forward_decode(self, q, layer_id, fb: ForwardBatch):
        if fb.prefix_groups:
            from kernels.reference import cascade_decode_attention_ref

            k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
            return cascade_decode_attention_ref(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices,
                                                fb.seq_lens, fb.prefix_groups, self.scaling)
        return self.forward_extend(q, None, None, layer_id, fb)
