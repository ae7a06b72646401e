"""A stand-in `flashinfer` module for CPU tests of the flashinfer attention backend: its wrappers attend in plain torch
over exactly the indices, offsets, lengths and page views they were planned with.

Every call is bound to flashinfer's own signature of the method (SIGNATURES, recorded from the pinned release), so a
misspelt keyword, a shifted positional or an option passed where the release takes none fails on the CPU as it would
on the GPU; test_flashinfer_backend.py checks the records against the real package where its wheel is at hand. The
wrappers also check what the release checks or silently relies on: int32 index arrays, page views in the planned
layout, q/k dtypes equal to the planned ones, graph-mode buffer sizes, and each request's KV length as FlashInfer's
host planner derives it from (pages, last_page_len) -- the length its sm90 kernels read.
"""
from __future__ import annotations

import inspect
import math

import torch

VERSION = "0.7.4"  # shared/engine/config.py's FLASHINFER_INSTALL pin

# flashinfer 0.7.4's signatures, annotations dropped (file:line in the 0.7.4 wheel, of the def).
SIGNATURES = {
    # flashinfer/decode.py:1421
    "BatchDecodeWithPagedKVCacheWrapper.__init__":
        "(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, use_tensor_cores=False, "
        "paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, "
        "backend='auto', jit_args=None, jit_kwargs=None)",
    # flashinfer/decode.py:1762
    "BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer":
        "(self, float_workspace_buffer, int_workspace_buffer)",
    # plan() (decode.py:2124) takes the first seven positionally and the options by keyword (positional options are
    # deprecated: a warning, then a legacy order), handing them to _plan_impl (decode.py:2278): the stand-in binds to
    # the latter, options keyword-only.
    "BatchDecodeWithPagedKVCacheWrapper._plan_impl":
        "(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, "
        "pos_encoding_mode='NONE', window_left=-1, window_right=0, logits_soft_cap=None, q_data_type='float16', "
        "kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, "
        "non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False, "
        "q_len_per_req=1, is_causal=None, use_token_head_sf=False)",
    # flashinfer/decode.py:3153
    "BatchDecodeWithPagedKVCacheWrapper.run":
        "(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
        "return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None, "
        "skip_softmax_threshold_scale_factor=None, kv_cache_sf=None)",
    # flashinfer/prefill.py:2935
    "BatchPrefillWithPagedKVCacheWrapper.__init__":
        "(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, qo_indptr_buf=None, "
        "paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, custom_mask_buf=None, "
        "mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None, variant_owns_mask=False, "
        "max_total_num_rows=None)",
    # flashinfer/prefill.py:3599
    "BatchPrefillWithPagedKVCacheWrapper.plan":
        "(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, "
        "head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, "
        "pos_encoding_mode='NONE', use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, "
        "rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, o_data_type=None, "
        "non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, "
        "max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None, "
        "max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False, uniform_q_len=None, "
        "use_token_head_sf=False)",
    # flashinfer/prefill.py:4661
    "BatchPrefillWithPagedKVCacheWrapper.run":
        "(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
        "return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None, window_left=None, sinks=None, "
        "kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None)",
    # flashinfer/prefill.py:5520
    "BatchPrefillWithRaggedKVCacheWrapper.__init__":
        "(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, qo_indptr_buf=None, kv_indptr_buf=None, "
        "custom_mask_buf=None, mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None, "
        "variant_owns_mask=False)",
    # flashinfer/prefill.py:5777
    "BatchPrefillWithRaggedKVCacheWrapper.plan":
        "(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None, "
        "packed_custom_mask=None, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, "
        "window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, "
        "q_data_type='float16', kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None, "
        "token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None, "
        "disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, max_sequence_kv=None, "
        "v_indptr=None, o_indptr=None, qo_indptr_cpu=None, kv_indptr_cpu=None, uniform_q_len=None, "
        "use_token_head_sf=False)",
    # flashinfer/prefill.py:6796
    "BatchPrefillWithRaggedKVCacheWrapper.run":
        "(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None, "
        "return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None, kv_cache_sf=None)",
    # flashinfer/cascade.py:42
    "merge_state": "(v_a, s_a, v_b, s_b)",
}

# The query / KV / output types FlashInfer's kernels are generated for (flashinfer/jit/utils.py:33: no float32).
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = Q_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


def signature(key: str) -> inspect.Signature:
    return inspect.signature(eval(f"lambda {SIGNATURES[key][1:-1]}: None"))  # a recorded constant, no input


def _bind(key: str, *args, **kwargs) -> dict:
    """The call's arguments by flashinfer's parameter names, defaults filled in (a TypeError where it would raise)."""
    b = signature(key).bind(*args, **kwargs)
    b.apply_defaults()
    out = dict(b.arguments)
    out.pop("self", None)
    assert not out.pop("args", ()), f"{key}: extra positional arguments (custom-kernel args)"
    return out


def _dtype(t) -> torch.dtype:
    return getattr(torch, t) if isinstance(t, str) else t  # flashinfer/utils.py canonicalize_torch_dtype


def _int32(*ts) -> None:
    assert all(t.dtype == torch.int32 for t in ts), [t.dtype for t in ts]


def _kv_lens(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    """Each request's KV length as FlashInfer's host planner derives it (flashinfer/page.py:391 get_seq_lens; the sm90
    kernels read that many page entries), checked to lie within the request's own pages."""
    pages = (indptr[1:] - indptr[:-1]).tolist()
    lens = [max(p - 1, 0) * page_size + int(last) for p, last in zip(pages, last_page_len.tolist())]
    for p, n in zip(pages, lens):
        assert (p - 1) * page_size < n <= p * page_size if p else n == 0, \
            f"last_page_len gives {n} tokens over {p} pages of {page_size}"
    return lens


def attend(q, k, v, scale, causal_from, lse=None):
    """q [n, Hq, D] over k, v [m, Hkv, D]; query i sees keys < causal_from + i + 1 (None: all). With `lse` (a
    [n, Hq] tensor), also writes the log2-sum-exp of the scores there (FlashInfer's convention; -inf: no keys)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if causal_from is not None:
        n, m = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.arange(m)[None, :] > causal_from + torch.arange(n)[:, None], float("-inf"))
    if lse is not None:
        lse.copy_((torch.logsumexp(s, -1) / math.log(2)).T)
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1).nan_to_num(0.0), v)


def merge_state(*args, **kwargs):
    a = _bind("merge_state", *args, **kwargs)
    v_a, s_a, v_b, s_b = a["v_a"], a["s_a"], a["v_b"], a["s_b"]
    assert s_a.dtype == s_b.dtype == torch.float32 and v_a.shape == v_b.shape and s_a.shape == v_a.shape[:2]
    s = torch.logaddexp(s_a * math.log(2), s_b * math.log(2)) / math.log(2)
    w_a, w_b = torch.exp2(s_a - s).nan_to_num(0.0), torch.exp2(s_b - s).nan_to_num(0.0)
    return (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]).to(v_a.dtype), s


class _Wrapper:
    NAME = ""
    plans: list = []  # (kind, graph mode) of every plan, in order

    def __init__(self, *args, **kwargs):
        a = self.init_args = _bind(f"{self.NAME}.__init__", self, *args, **kwargs)
        ws = a["float_workspace_buffer"]
        assert a["kv_layout"] == "NHD" and ws.dtype == torch.uint8 and not ws.any()  # "must be initialized to 0"
        self.graph = a["use_cuda_graph"]

    def _plan_types(self, a: dict, heads: tuple) -> None:
        assert heads[0] % heads[1] == 0
        self.heads = heads
        self.q_type = _dtype(a["q_data_type"])
        self.kv_type = _dtype(a["kv_data_type"]) if a["kv_data_type"] is not None else self.q_type
        self.o_type = _dtype(a["o_data_type"]) if a["o_data_type"] is not None else self.q_type
        assert self.q_type in Q_DTYPES and self.o_type in Q_DTYPES and self.kv_type in KV_DTYPES
        self.scale = a["sm_scale"] if a["sm_scale"] is not None else heads[2] ** -0.5
        assert a["logits_soft_cap"] in (None, 0.0) and a["window_left"] == -1 and a["pos_encoding_mode"] == "NONE"

    def _check_q(self, q, k) -> None:
        """flashinfer/utils.py:440 _check_cached_qkv_data_type, and the planned head counts."""
        assert q.dtype == self.q_type and k.dtype == self.kv_type, (q.dtype, self.q_type, k.dtype, self.kv_type)
        assert q.shape[1:] == self.heads[::2] and k.shape[-2:] == self.heads[1:]

    def _paged(self, q, pages, qo, kv, lens, indices, return_lse, k_scale, v_scale, lse_base="log2"):
        k_pages, v_pages = pages
        assert k_pages.shape[1] == 1 and k_pages.shape == v_pages.shape  # NHD pages of one token
        self._check_q(q, k_pages)
        out = torch.empty(q.shape, dtype=self.o_type)
        lse = torch.empty(q.shape[:2])
        for b, n in enumerate(lens):
            slots = indices[kv[b]:kv[b] + n].long()
            qs = slice(qo[b], qo[b + 1])
            k = k_pages[slots, 0].float() * (k_scale or 1.0)
            out[qs] = attend(q[qs], k, v_pages[slots, 0].float() * (v_scale or 1.0), self.scale, None, lse[qs])
        if lse_base == "ln":
            lse *= math.log(2)
        return (out, lse) if return_lse else out


class Decode(_Wrapper):
    NAME = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.init_args
        if self.graph:  # decode.py's graph-mode checks: tensors, indptr one longer than last_page_len
            self.buffers = (a["paged_kv_indptr_buffer"], a["paged_kv_indices_buffer"],
                            a["paged_kv_last_page_len_buffer"])
            _int32(*self.buffers)
            assert len(self.buffers[0]) == len(self.buffers[2]) + 1

    def reset_workspace_buffer(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.reset_workspace_buffer", self, *args, **kwargs)
        assert self.graph and a["int_workspace_buffer"].dtype == torch.uint8

    def plan(self, *args, **kwargs):
        a = _bind(f"{self.NAME}._plan_impl", self, *args, **kwargs)
        indptr, indices, last = a["indptr"], a["indices"], a["last_page_len"]
        _int32(indptr, indices, last)
        assert indptr.device.type == "cpu" and a["page_size"] == 1 and a["q_len_per_req"] == 1
        self._plan_types(a, (a["num_qo_heads"], a["num_kv_heads"], a["head_dim"]))
        self.lens = _kv_lens(indptr, last, a["page_size"])
        if self.graph:  # as FlashInfer: copied into the fixed buffers, batch size fixed
            assert len(indices) <= len(self.buffers[1]) and len(last) == len(self.buffers[2])
            self.buffers[0].copy_(indptr)
            self.buffers[1][:len(indices)].copy_(indices)
            self.indptr, self.indices = self.buffers[0], self.buffers[1]
        else:
            self.indptr, self.indices = indptr, indices
        _Wrapper.plans.append(("decode", self.graph))

    def run(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.run", self, *args, **kwargs)
        q = a["q"]
        assert q.shape[0] == len(self.lens)
        return self._paged(q, a["paged_kv_cache"], list(range(len(self.lens) + 1)), self.indptr.tolist(), self.lens,
                           self.indices, a["return_lse"], a["k_scale"], a["v_scale"])


class Paged(_Wrapper):
    NAME = "BatchPrefillWithPagedKVCacheWrapper"

    def plan(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.plan", self, *args, **kwargs)
        qo, kv, indices, last = a["qo_indptr"], a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"]
        _int32(qo, kv, indices, last)
        assert not a["causal"] and a["page_size"] == 1  # the backend's use: the cached prefix, all of it
        assert len(qo) == len(kv) == len(last) + 1 and int(kv[-1]) == len(indices)
        self._plan_types(a, (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"]))
        self.qo, self.kv, self.indices = qo.tolist(), kv.tolist(), indices
        self.lens = _kv_lens(kv, last, a["page_size"])
        _Wrapper.plans.append(("paged", False))

    def run(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.run", self, *args, **kwargs)
        assert a["q"].shape[0] == self.qo[-1]
        return self._paged(a["q"], a["paged_kv_cache"], self.qo, self.kv, self.lens, self.indices, a["return_lse"],
                           a["k_scale"], a["v_scale"], a["lse_base"])


class Ragged(_Wrapper):
    NAME = "BatchPrefillWithRaggedKVCacheWrapper"

    def plan(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.plan", self, *args, **kwargs)
        _int32(a["qo_indptr"], a["kv_indptr"])
        self._plan_types(a, (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"]))
        self.qo, self.kv, self.causal = a["qo_indptr"].tolist(), a["kv_indptr"].tolist(), a["causal"]
        _Wrapper.plans.append(("ragged", False))

    def run(self, *args, **kwargs):
        a = _bind(f"{self.NAME}.run", self, *args, **kwargs)
        q, k, v = a["q"], a["k"], a["v"]
        assert k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and len(k) == self.kv[-1]
        self._check_q(q, k)
        out, lse = torch.empty(q.shape, dtype=self.o_type), torch.empty(q.shape[:2])
        for b in range(len(self.qo) - 1):
            qs, ks = slice(self.qo[b], self.qo[b + 1]), slice(self.kv[b], self.kv[b + 1])
            # Causal: bottom-right aligned, the last query sees every key.
            shift = (ks.stop - ks.start) - (qs.stop - qs.start) if self.causal else None
            out[qs] = attend(q[qs], k[ks], v[ks], self.scale, shift, lse[qs])
        if a["lse_base"] == "ln":
            lse *= math.log(2)
        return (out, lse) if a["return_lse"] else out
