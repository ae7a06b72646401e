"""A batch's KV slots as one flat index list (CSR): what paged-attention libraries (FlashInfer) read with a page of
one token, from the engine's slot table, on the device.

Request b's context is req_to_token[req_pool_indices[b], :seq_lens[b]]; its slots land at
out[indptr[b] : indptr[b] + seq_lens[b]]. Reads only device tensors, so it runs inside a captured CUDA graph,
after the graph's own slot-table write of the step's new token. Off the GPU (and outside the interpreter) the torch
version runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_kv_indices_kernel(REQ_TO_TOKEN, stride_rt, RPI, SEQ_LENS, INDPTR, OUT, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(RPI + b).to(tl.int64)
    n = tl.load(SEQ_LENS + b)
    start = tl.load(INDPTR + b).to(tl.int64)
    for off in range(0, n, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n
        slots = tl.load(REQ_TO_TOKEN + row * stride_rt + cols, mask=mask)
        tl.store(OUT + start + cols, slots, mask=mask)


def paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """req_to_token int32 [rows, max_len] (unit column stride); req_pool_indices [B]; seq_lens int32 [B];
    indptr int32 [>= B] (request b's first index); out int32 [>= total]. Returns out."""
    from kernels._utils import triton_usable

    B = req_pool_indices.shape[0]
    assert req_to_token.dtype == out.dtype == torch.int32 and req_to_token.stride(1) == 1
    if not triton_usable(out.device):
        return paged_kv_indices_ref(req_to_token, req_pool_indices, seq_lens, indptr, out)
    if B:
        _paged_kv_indices_kernel[(B,)](req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, indptr, out,
                                       BLOCK=512, num_warps=4)
    return out


def paged_kv_indices_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """paged_kv_indices in plain torch (reads the lengths on the host: a sync)."""
    for row, n, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), indptr.tolist()):
        out[start:start + n] = req_to_token[row, :n]
    return out
