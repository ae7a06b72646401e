"""The attention-backend interface. Every backend (torch, triton) implements it."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shared.models.forward_batch import ForwardBatch, ForwardMode


class AttentionBackend(ABC):
    # True when forward() can be captured in a CUDA graph (no host syncs, shapes fixed by batch size).
    graph_safe: bool = False
    # Extend passes may be captured too (shared/engine/extend_graph.py): forward_extend reads no host
    # copies of the batch, and fb.max_extend_len, when set, bounds every request's new tokens.
    extend_graph_safe: bool = False
    # Shared-prefix (cascade) decode: whether the backend has it, and when it pays. A batch with such
    # groups runs in a captured graph where the backend can capture it (graph_cascade), eagerly
    # otherwise.
    supports_cascade: bool = False
    # Whether forward_extend reads the new tokens' k/v (and q) as passed, fast enough on contiguous copies
    # to pay for them: the rope + KV-store kernel then writes q, k, v to new [T, H, D] tensors instead of
    # rotating views of the fused qkv output in place. Backends that read k/v from the pool leave it off.
    extend_contiguous_qkv: bool = False
    cascade_min_group = 4  # requests sharing the prefix
    cascade_min_prefix = 256  # tokens of shared prefix
    cascade_min_saved_tokens = 65536  # prefix tokens not re-read in the whole batch (sum over groups)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling if scaling is not None else head_dim ** -0.5
        self.cascade_enabled = self.supports_cascade

    def select_prefix_groups(self, groups: list[tuple[int, list[int]]] | None) -> list[tuple[int, list[int]]] | None:
        """The groups worth attending once per group in this decode batch, each request in at most one,
        or None: plain decode. `groups` nest (RadixCache.shared_prefix_groups): every request starts in
        its shallowest eligible group, and moves, with the others of a deeper group, into that one when
        that saves prefix reads. So a whole group follows its prefix down a chain of nodes (a prompt
        inserted chunk by chunk), while two questions of a 16-request system prompt that happen to share
        a first token stay with the other fourteen."""
        if not (self.cascade_enabled and groups):
            return None
        eligible = sorted(((p, m) for p, m in groups if len(m) >= self.cascade_min_group
                           and p >= self.cascade_min_prefix), key=lambda g: g[0])
        at: dict[int, int] = {}  # request -> index into eligible of its group
        size: dict[int, int] = {}  # group index -> requests in it now
        for gi, (p, members) in enumerate(eligible):
            # Nested groups, shallow first: a deeper group's members are all in one group by now, or none.
            cur = at.get(members[0])
            if cur is not None:
                p_cur, left = eligible[cur][0], size[cur] - len(members)
                # Prefix reads saved: each member's suffix shrinks by p - p_cur; the group reads p once,
                # and the old group's read goes if it empties, while members left in a group too small to
                # run read their prefix alone.
                gain = len(members) * (p - p_cur) - p
                if left == 0:
                    gain += p_cur
                elif left < self.cascade_min_group:
                    gain -= (left - 1) * p_cur
                if gain <= 0:
                    continue
                size[cur] = left
            for b in members:
                at[b] = gi
            size[gi] = len(members)
        chosen: dict[int, list[int]] = {}
        for b, gi in at.items():
            chosen.setdefault(gi, []).append(b)
        keep = [(eligible[gi][0], sorted(m)) for gi, m in sorted(chosen.items()) if len(m) >= self.cascade_min_group]
        saved = sum(p * (len(m) - 1) for p, m in keep)
        return keep if keep and saved >= self.cascade_min_saved_tokens else None

    def graph_cascade(self) -> bool:
        """Whether shared-prefix decode can be captured in CUDA graphs (a ForwardBatch with
        graph_cascade set, its groups staged by load_graph_cascade before each replay)."""
        return False

    def plan_graph_cascade(self, batch_size: int, groups: list[tuple[int, list[int]]], req_rows: list[int],
                           num_reqs: int):
        """A batch's groups laid out for the captured shared-prefix graph of this batch size (a plain,
        picklable value the tensor-parallel ranks all load), or None when they do not fit its capacities
        (the batch then runs eagerly). num_reqs <= batch_size real rows."""
        return None

    def load_graph_cascade(self, batch_size: int, plan, num_reqs: int) -> None:
        """Put a plan_graph_cascade result where the graph of this batch size reads it."""
        raise NotImplementedError

    def rider_counts(self, max_riders: int) -> list[int]:
        """Numbers of one-token rows (riders of a mixed prefill pass) whose passes between them use every kernel
        variant this backend runs riders with: what a warm-up runs (largest first)."""
        return [max_riders]

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Called once per forward before layer 0: precompute what every layer shares."""

    def before_graph_replay(self, batch_size: int, seq_lens: list[int]) -> None:
        """Host-side planning before a decode graph of this batch size replays (seq_lens: every row's context
        length, padding rows included), for backends that plan on the host (FlashInfer); a no-op otherwise."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch, rotary=None, stored: bool = False) -> torch.Tensor:
        """q: [T, num_heads*head_dim]; k, v: [T, num_kv_heads*head_dim] for the new tokens.

        With `rotary` (a RotaryEmbedding) q and k are rotated in place at fb.positions first, in the
        same kernel as the KV store. Stores k/v into the pool at fb.out_cache_loc, then attends each
        new token to its request's full causal context. Returns [T, num_heads*head_dim].
        stored: q is rotated and k, v are in the pool already (the qkv GEMV's epilogue did both).
        """
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if stored:
            assert rotary is None
        elif rotary is None:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        else:
            k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
            q, k, v = rotary.rotate_and_store(fb.positions, q, k, v, k_buf, v_buf, fb.out_cache_loc,
                                              out=self.extend_contiguous_qkv and fb.mode != ForwardMode.DECODE,
                                              kv_scales=fb.kv_pool.scales[layer_id])
        if fb.mode == ForwardMode.DECODE:
            o = self.forward_decode(q, layer_id, fb)
        else:
            o = self.forward_extend(q, k, v, layer_id, fb)
        return o.reshape(T, self.num_heads * self.head_dim)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D]; the new tokens' k/v are already in the pool (also passed: backends read them as passed,
        which with an FP8 pool are the unrounded values). Returns [T, Hq, D]."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        """q: [B, Hq, D], one token per request. Returns [B, Hq, D]."""
