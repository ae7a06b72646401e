"""Attention backend on FlashInfer's public wrappers (--attention-backend flashinfer): the kernels SGLang runs by
default, the peer our Triton kernels are measured against. An optional extra, imported only when chosen.

The engine's pool (one K and one V buffer a layer, [slots, kv heads, head dim]) is FlashInfer's NHD paged layout
with a page of one token, viewed without a copy as [slots, 1, kv heads, head dim]; a request's page indices are its
slots, gathered from the slot table on the device (kernels/attention/paged_kv_indices.py). Each pass plans once
(before layer 0) and every layer runs on that plan:

- decode: BatchDecodeWithPagedKVCacheWrapper (fa2; tensor cores from DECODE_TENSOR_CORES_MIN_GROUP query heads per
  KV head, SGLang's rule). In CUDA graphs: one graph-mode wrapper per captured batch size over fixed buffers; the
  graph gathers the indices itself (after its own slot-table write), and the graph runner re-plans on the host
  before each replay (before_graph_replay), as FlashInfer's graph mode asks.
- extend: BatchPrefillWithRaggedKVCacheWrapper over the new k/v as computed (causal); where requests have a cached
  prefix, also BatchPrefillWithPagedKVCacheWrapper over the prefix in the pool (every new token sees all of it),
  the two merged by their log-sum-exps (merge_state), as SGLang's FlashInfer backend splits an extend.

Not here (the Triton backend's): shared-prefix (cascade) decode, so prefix groups decode per request; CUDA graphs
of extend passes, so those run eagerly.
"""
from __future__ import annotations

import torch

from kernels.attention.paged_kv_indices import paged_kv_indices
from kernels.h2d import to_device
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.models.attention.base import AttentionBackend

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch, shared by every wrapper (passes run in stream order)
DECODE_TENSOR_CORES_MIN_GROUP = 4
GRAPH_INT_WORKSPACE_BYTES = 8 << 20  # what each FlashInfer wrapper allocates for itself
HEAD_DIMS = (64, 128, 256)  # what FlashInfer's decode and prefill kernels are built for (its own dispatch tables)
# The query / output types its kernels are generated for (flashinfer/jit/utils.py:33 maps no float32: a KeyError at
# the first plan otherwise).
MODEL_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer():
    """The flashinfer module, or a ValueError naming the install command (and the other backends)."""
    try:
        import flashinfer
    except ImportError as e:
        from shared.engine.config import flashinfer_missing

        raise ValueError(flashinfer_missing(f"import flashinfer failed: {e}")) from e
    return flashinfer


def indptr_of(lens: list[int]) -> torch.Tensor:
    """CSR offsets of these lengths: int32 [len + 1] on the host."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


class _GraphDecode:
    """One captured batch size's wrapper and the fixed buffers its graph reads. Every graph shares one device int
    workspace (the plan's schedule) instead of 8 MB each (83 graphs up to batch 1,024): each replay is planned
    right before it, in stream order, so no graph reads another's plan."""

    def __init__(self, fi, workspace, int_workspace, bs: int, indices: torch.Tensor, tensor_cores: bool):
        dev = workspace.device
        self.bs = bs
        self.indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
        self.indices = indices
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=self.last_page_len, backend="fa2")
        self.wrapper.reset_workspace_buffer(workspace, int_workspace)


class FlashInferAttentionBackend(AttentionBackend):
    graph_safe = True
    extend_contiguous_qkv = True  # the ragged prefill reads the new k/v as passed

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16):
        super().__init__(num_heads, num_kv_heads, head_dim, scaling)
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"the flashinfer attention backend runs head dims {', '.join(map(str, HEAD_DIMS))}; this "
                             f"model's is {head_dim}: use triton")
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"the flashinfer attention backend runs float16 and bfloat16 models; this one is "
                             f"{str(dtype).replace('torch.', '')}: use triton")
        self.fi = import_flashinfer()
        self.device = torch.device(device)
        self.dtype = dtype  # q and outputs (the model's dtype); the pool's may be FP8
        self.tensor_cores = num_heads // num_kv_heads >= DECODE_TENSOR_CORES_MIN_GROUP
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                  use_tensor_cores=self.tensor_cores, backend="fa2")
        self._paged = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._ragged = self.fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._graphs: dict[int, _GraphDecode] = {}
        self._graph_indices: torch.Tensor | None = None  # [largest batch x context] slots, shared by the graphs
        self._graph_int_workspace = torch.empty(GRAPH_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._run = None  # this pass's attention: (q, k, v, layer, fb) -> out
        self._run_batch: ForwardBatch | None = None
        self._kv_dtype = dtype  # the pool's, learnt from each pass (graph replays plan with the last one's)
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> recorded after its last plan's copies

    # ------------------------------------------------------------------ planning
    def _plan(self, wrapper, *args, **kwargs) -> None:
        """wrapper.plan(...). A plan writes the wrapper's pinned host buffer and copies it to the device
        asynchronously; with overlap scheduling the pass before may still wait for that copy, so the wrapper's next
        plan first waits for its last one's copies (they precede that pass's kernels: in practice done already)."""
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.device.type == "cuda":
            self._planned.setdefault(id(wrapper), torch.cuda.Event()).record()

    def _plan_decode(self, wrapper, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                     kv_dtype: torch.dtype) -> None:
        self._plan(wrapper, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, 1,
                   q_data_type=self.dtype, kv_data_type=kv_dtype, o_data_type=self.dtype, sm_scale=self.scaling)

    def _graph(self, bs: int, req_to_token: torch.Tensor) -> _GraphDecode:
        g = self._graphs.get(bs)
        need = bs * req_to_token.shape[1]
        if g is None or g.indices.numel() < need:  # (a longer slot table than before: a benchmark's, not the engine's)
            if self._graph_indices is None or self._graph_indices.numel() < need:
                # Graphs are captured largest batch first: the first one sizes the buffer for all.
                self._graph_indices = torch.zeros(need, dtype=torch.int32, device=self.device)
            g = self._graphs[bs] = _GraphDecode(self.fi, self.workspace, self._graph_int_workspace, bs,
                                                self._graph_indices, self.tensor_cores)
        return g

    def before_graph_replay(self, batch_size: int, seq_lens: list[int]) -> None:
        g = self._graphs[batch_size]
        # No indices: graph-mode plan() copies what it is given into the fixed indices buffer, which the graph
        # fills itself (the fa2 plan reads only the lengths).
        self._plan_decode(g.wrapper, indptr_of(seq_lens), g.indices[:0], torch.ones(batch_size, dtype=torch.int32),
                          self._kv_dtype)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._run_batch = fb
        self._kv_dtype = fb.kv_pool.dtype
        r2t = fb.req_to_token
        if fb.mode == ForwardMode.DECODE:
            if fb.seq_lens_cpu is None:  # a CUDA-graph batch (shared/engine/cuda_graph.py): device tensors only
                g = self._graph(fb.batch_size, r2t)
                if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # capture warm-ups
                    self.before_graph_replay(fb.batch_size, fb.seq_lens.tolist())
                paged_kv_indices(r2t, fb.req_pool_indices, fb.seq_lens, g.indptr, g.indices)
                wrapper = g.wrapper
            else:
                indptr = indptr_of(fb.seq_lens_cpu)
                indices = torch.empty(int(indptr[-1]), dtype=torch.int32, device=self.device)
                paged_kv_indices(r2t, fb.req_pool_indices, fb.seq_lens, to_device(indptr, torch.int32, self.device),
                                 indices)
                self._plan_decode(self._decode, indptr, indices, torch.ones(fb.batch_size, dtype=torch.int32),
                                  fb.kv_pool.dtype)
                wrapper = self._decode
            self._run = lambda q, k, v, layer, fb: wrapper.run(q, self._pages(fb, layer), **self._scales(fb, layer))
            return
        ext, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        assert ext is not None and prefix is not None, "the flashinfer backend plans extend passes from host lengths"
        qo_indptr = indptr_of(ext)
        self._plan(self._ragged, qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads, self.head_dim,
                   causal=True, sm_scale=self.scaling, q_data_type=self.dtype, kv_data_type=self.dtype,
                   o_data_type=self.dtype)
        if not any(prefix):
            self._run = lambda q, k, v, layer, fb: self._ragged.run(q, k, v)
            return
        # SGLang's split: the new tokens among themselves (ragged, causal) and over the cached prefix in the pool
        # (paged, all of it), merged by their log-sum-exps.
        kv_indptr = indptr_of(prefix)
        indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=self.device)
        paged_kv_indices(r2t, fb.req_pool_indices, fb.extend_prefix_lens,
                         to_device(kv_indptr, torch.int32, self.device), indices)
        # A request's KV length is (pages - 1) * page_size + last_page_len over its pages, and last_page_len alone
        # where it has none (flashinfer/page.py:391, the length the sm90 schedule hands its kernels): 0, not 1, for a
        # request without a prefix, or an H100's paged prefill reads the next request's first slot (or past the end).
        last_page_len = torch.tensor([min(n, 1) for n in prefix], dtype=torch.int32)
        self._plan(self._paged, qo_indptr, kv_indptr, indices, last_page_len,
                   self.num_heads, self.num_kv_heads, self.head_dim, 1, causal=False, sm_scale=self.scaling,
                   q_data_type=self.dtype, kv_data_type=fb.kv_pool.dtype, o_data_type=self.dtype)
        self._run = self._extend_over_prefix

    def _extend_over_prefix(self, q, k, v, layer: int, fb: ForwardBatch) -> torch.Tensor:
        o_new, lse_new = self._ragged.run(q, k, v, return_lse=True)
        o_prefix, lse_prefix = self._paged.run(q, self._pages(fb, layer), return_lse=True, **self._scales(fb, layer))
        return self.fi.merge_state(o_new, lse_new, o_prefix, lse_prefix)[0]

    # ------------------------------------------------------------------ running
    @staticmethod
    def _pages(fb: ForwardBatch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool as FlashInfer's NHD pages of one token, without a copy."""
        k_buf, v_buf = fb.kv_pool.get_kv(layer)
        return k_buf.unsqueeze(1), v_buf.unsqueeze(1)

    @staticmethod
    def _scales(fb: ForwardBatch, layer: int) -> dict:
        k_scale, v_scale = fb.kv_pool.scales[layer]
        return {} if (k_scale, v_scale) == (1.0, 1.0) else {"k_scale": k_scale, "v_scale": v_scale}

    def _attend(self, q, k, v, layer_id, fb):
        if self._run_batch is not fb:
            self.init_forward_metadata(fb)
        return self._run(q.contiguous(), k, v, layer_id, fb)

    def forward_extend(self, q, k, v, layer_id, fb: ForwardBatch):
        return self._attend(q, k, v, layer_id, fb)

    def forward_decode(self, q, layer_id, fb: ForwardBatch):
        return self._attend(q, None, None, layer_id, fb)
