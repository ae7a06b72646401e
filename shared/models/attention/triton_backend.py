"""Attention backend on the Triton kernels: paged decode (flash-decoding) and extend over a cached prefix."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._utils import next_pow2
from kernels.attention.triton_cascade import (CascadePlan, CascadeShape, cascade_decode_attention, plan_cascade,
                                             plan_cascade_host)
from kernels.attention.triton_decode import (MAX_KV_SPLITS, MIN_TOKENS_PER_SPLIT, decode_attention,
                                             num_kv_splits_for, plan_max_kv_splits)
from kernels.attention.triton_extend import extend_attention, extend_block_sizes, extend_pack
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.knobs import knob
from shared.models.attention.base import AttentionBackend
from shared.models.attention.torch_backend import TorchAttentionBackend

MAX_HEAD_DIM = 256  # one head row must fit a tile; larger heads go to the torch backend


@dataclass
class _DecodeMetadata:
    max_kv_splits: int
    num_kv_splits: torch.Tensor  # [B] int32, on device
    # [B, Hq, max_kv_splits, D] / [B, Hq, max_kv_splits] fp32 scratch shared by all layers; None when
    # one split per request lets the decode kernel write its output in a single launch.
    mid_o: torch.Tensor | None
    mid_lse: torch.Tensor | None
    cascade: CascadePlan | None = None  # shared-prefix groups (scratch then has its prefix columns too)
    # [>= B * Hkv] int32 counters, zero between launches: the split chunks are merged by the last program
    # of each (request, KV head) in the same launch. None: by a second launch (or no split at all).
    tickets: torch.Tensor | None = None


# An extend pass whose last requests compute one token each (decode rows riding along: mixed chunks,
# jump-forward catch-up) runs them with the decode kernel when that saves at least this many of the extend
# grid's empty programs: its grid covers the longest request's query blocks for every request, so each
# one-token row leaves all its blocks but the first to start and exit. Not yet measured on a GPU.
DECODE_TAIL_MIN_EMPTY_PROGRAMS = knob("DECODE_TAIL_MIN_EMPTY_PROGRAMS")


@dataclass
class _ExtendMetadata:
    max_extend_len: int
    # The decode tail: requests [head, B) compute one token each, tokens [head_tokens, T), run by the decode
    # kernel with this metadata; None: the extend kernel runs every request.
    head: int = 0
    head_tokens: int = 0
    tail: _DecodeMetadata | None = None


class TritonAttentionBackend(AttentionBackend):
    """Decode metadata is built from device tensors only (no host sync), so init_forward_metadata may run
    inside a captured CUDA graph. If it runs outside, replays keep the captured split counts, which is
    still correct: any split count from 1 to max_kv_splits yields the same attention."""

    graph_safe = True  # plain decode, and shared-prefix decode from static plans (graph_cascade)
    supports_cascade = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None,
                 max_kv_splits: int = MAX_KV_SPLITS, min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
                 one_launch_decode: bool = True):
        super().__init__(num_heads, num_kv_heads, head_dim, scaling)
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.max_kv_splits = max_kv_splits
        self.min_tokens_per_split = min_tokens_per_split
        # Split decode merged in the same launch (the last program per request and KV head) instead of by
        # a second kernel, as the engine runs it by default (the two-launch form serves a caller that asks for it).
        self.one_launch_decode = one_launch_decode
        self._tickets: torch.Tensor | None = None
        self._retired_tickets: list[torch.Tensor] = []
        self.fallback = (TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scaling)
                         if head_dim > MAX_HEAD_DIM else None)
        # Extend reads only device tensors, its grid bounded by fb.max_extend_len (not the torch fallback).
        self.extend_graph_safe = self.fallback is None
        # The extend kernel streams k and v once per query block: contiguous copies (one write of v more)
        # read faster than rows a whole qkv row apart (docs/kernels.md).
        # Decode reads q once and stays in place.
        self.extend_contiguous_qkv = self.fallback is None
        self._meta: _DecodeMetadata | _ExtendMetadata | None = None
        self._meta_batch: ForwardBatch | None = None
        self._graph_plans: dict[int, CascadePlan] = {}  # batch size -> static plan a captured graph reads

    def graph_cascade(self) -> bool:
        return self.cascade_enabled and self.fallback is None

    def _graph_plan(self, batch_size: int, device) -> CascadePlan:
        plan = self._graph_plans.get(batch_size)
        if plan is None:
            shape = CascadeShape.for_graph(batch_size, self.num_heads // self.num_kv_heads, self.cascade_min_group)
            plan = self._graph_plans[batch_size] = CascadePlan.empty(shape, batch_size, device)
        return plan

    def plan_graph_cascade(self, batch_size, groups, req_rows, num_reqs):
        static = self._graph_plans.get(batch_size)  # made when the graph was captured
        if static is None:
            return None
        host = plan_cascade_host(groups, req_rows, num_reqs, self.num_kv_heads, self.num_heads // self.num_kv_heads,
                                 static.shape)
        return host if host is not None and host.fits(static.shape) else None

    def load_graph_cascade(self, batch_size, plan, num_reqs) -> None:
        static = self._graph_plans.get(batch_size)
        if static is None or not plan.fits(static.shape):
            raise RuntimeError(f"no shared-prefix graph of batch size {batch_size} holds this plan")
        static.load(plan, num_reqs)

    def _decode_tickets(self, rows: int, device) -> torch.Tensor:
        """The one-launch merge's counters, zero, at least `rows` of them. One buffer for every batch: the
        kernels leave it zero. A larger batch gets a new one, and the old stays allocated: a captured
        graph keeps using the address it was captured with. (Graph capture runs each forward first
        outside the capture, largest batch first, so the buffer is made there, not inside a capture.)"""
        if self._tickets is None or self._tickets.numel() < rows:
            if self._tickets is not None:
                self._retired_tickets.append(self._tickets)
            self._tickets = torch.zeros(next_pow2(rows), dtype=torch.int32, device=device)
        return self._tickets

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._meta_batch = fb
        if self.fallback is not None:
            return
        if fb.mode == ForwardMode.DECODE:
            plan = None
            if fb.graph_cascade:
                plan = self._graph_plan(fb.batch_size, fb.seq_lens.device)
            elif fb.prefix_groups:
                plan = plan_cascade(fb.prefix_groups, fb.req_pool_indices_cpu, fb.batch_size, self.num_kv_heads,
                                    self.num_heads // self.num_kv_heads, fb.seq_lens.device)
            self._meta = self._decode_metadata(fb.seq_lens, plan)
        else:
            lens = fb.extend_seq_lens_cpu
            # Without host copies the packed token count bounds every request's length.
            bound = fb.max_extend_len if fb.max_extend_len is not None else max(lens) if lens else fb.num_tokens
            self._meta = self._extend_metadata(fb, bound)

    def _decode_metadata(self, seq_lens: torch.Tensor, plan: CascadePlan | None) -> _DecodeMetadata:
        B = seq_lens.shape[0]
        splits = plan_max_kv_splits(B, self.num_kv_heads, self.max_kv_splits)
        dev = seq_lens.device
        kv_lens = seq_lens if plan is None else seq_lens - plan.kv_start
        cols = splits + (plan.prefix_splits if plan is not None else 0)
        scratch = cols > 1
        return _DecodeMetadata(
            max_kv_splits=splits,
            num_kv_splits=num_kv_splits_for(kv_lens, splits, self.min_tokens_per_split),
            mid_o=(torch.empty((B, self.num_heads, cols, self.head_dim), dtype=torch.float32, device=dev)
                   if scratch else None),
            mid_lse=torch.empty((B, self.num_heads, cols), dtype=torch.float32, device=dev) if scratch else None,
            cascade=plan,
            tickets=(self._decode_tickets(B * self.num_kv_heads, dev) if self.one_launch_decode and splits > 1
                     else None))

    def rider_counts(self, max_riders: int) -> list[int]:
        """The largest rider count of each split plan the decode tail can have (the plan sets the kernel's
        compiled variant): the largest, since a tail is taken where riders times the prompt's query blocks pass
        DECODE_TAIL_MIN_EMPTY_PROGRAMS, so a plan's tail exists somewhere only if it does at its largest count."""
        largest: dict[int, int] = {}
        for r in range(1, max_riders + 1):
            largest[plan_max_kv_splits(r, self.num_kv_heads, self.max_kv_splits)] = r
        return sorted(largest.values(), reverse=True)

    def _extend_metadata(self, fb: ForwardBatch, bound: int) -> _ExtendMetadata:
        """The extend kernel's grid bound, and a decode tail where it pays (DECODE_TAIL_MIN_EMPTY_PROGRAMS);
        only with the lengths on the host (not in an extend graph, whose grid is fixed)."""
        lens = fb.extend_seq_lens_cpu
        if fb.max_extend_len is not None or not lens or lens[-1] != 1:
            return _ExtendMetadata(bound)
        head = len(lens)
        while head and lens[head - 1] == 1:
            head -= 1
        longest = max(lens[:head], default=1)
        pack = extend_pack(self.num_heads, self.num_kv_heads)
        # The extend grid extend_attention would launch: query blocks of the longest request, for every one.
        block_m = extend_block_sizes(next_pow2(self.head_dim), fb.kv_pool.dtype,
                                     longest * pack if pack > 1 else None)[0]
        blocks = -(-longest // max(1, block_m // pack))
        if (len(lens) - head) * (blocks - 1) * (self.num_heads // pack) < DECODE_TAIL_MIN_EMPTY_PROGRAMS:
            return _ExtendMetadata(bound)
        return _ExtendMetadata(longest, head, sum(lens[:head]), self._decode_metadata(fb.seq_lens[head:], None))

    def _metadata(self, fb: ForwardBatch):
        if self._meta_batch is not fb or self._meta is None:
            self.init_forward_metadata(fb)
        return self._meta

    def forward_extend(self, q, k, v, layer_id, fb: ForwardBatch):
        if self.fallback is not None:
            return self.fallback.forward_extend(q, k, v, layer_id, fb)
        meta = self._metadata(fb)
        k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
        k_scale, v_scale = fb.kv_pool.scales[layer_id]
        if meta.tail is None:
            return extend_attention(q, k, v, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices,
                                    fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc,
                                    meta.max_extend_len, self.scaling, k_scale=k_scale, v_scale=v_scale)
        # The one-token rows at the end: their k/v are in the pool already, so they are decode rows.
        h, t0, tail = meta.head, meta.head_tokens, meta.tail
        out = torch.empty_like(q)
        if h:
            extend_attention(q, k, v, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices[:h],
                             fb.extend_prefix_lens[:h], fb.extend_seq_lens[:h], fb.extend_start_loc[:h],
                             meta.max_extend_len, self.scaling, out=out, k_scale=k_scale, v_scale=v_scale)
        decode_attention(q[t0:], k_buf, v_buf, fb.req_to_token, fb.req_pool_indices[h:], fb.seq_lens[h:],
                         tail.num_kv_splits, tail.max_kv_splits, self.scaling, out=out[t0:], mid_o=tail.mid_o,
                         mid_lse=tail.mid_lse, tickets=tail.tickets, k_scale=k_scale, v_scale=v_scale)
        return out

    def forward_decode(self, q, layer_id, fb: ForwardBatch):
        if self.fallback is not None:
            return self.fallback.forward_decode(q, layer_id, fb)
        meta = self._metadata(fb)
        k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
        k_scale, v_scale = fb.kv_pool.scales[layer_id]
        if meta.cascade is not None:
            return cascade_decode_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                            meta.cascade, meta.num_kv_splits, meta.max_kv_splits, self.scaling,
                                            mid_o=meta.mid_o, mid_lse=meta.mid_lse, tickets=meta.tickets,
                                            k_scale=k_scale, v_scale=v_scale)
        return decode_attention(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                meta.num_kv_splits, meta.max_kv_splits, self.scaling,
                                mid_o=meta.mid_o, mid_lse=meta.mid_lse, tickets=meta.tickets,
                                k_scale=k_scale, v_scale=v_scale)
