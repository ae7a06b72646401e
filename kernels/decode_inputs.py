"""A decode step's inputs unpacked on the device, from one host-to-device copy.

The host stages a step as one int64 block `staged` [B, 4], four numbers per request: its row in the slot
table, its context length after this step, the KV slot of its new token, and the slot-table entry to
write (the same slot; kept apart so the table holds exactly what the scheduler assigned). Row-major, so
the first B requests of a larger block are laid out the same way: every captured batch size reads its
prefix of one buffer. One kernel then writes what the forward pass reads: the input token (the request
row's last sample, in `token_buf`), its position, the request rows and KV slots as int64, the context
and prefix lengths as int32, and the new slot-table entry. Inside the decode CUDA graph this replaces
~14 small copies and ~10 small kernels a step (host launch work; with overlap scheduling it was already hidden at
steady state: docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS, SEQ, LOC, TABLE = range(4)  # the columns of `staged`


@triton.jit
def _decode_inputs_kernel(STAGED, TOKEN_BUF, REQ_TO_TOKEN, stride_rt, IDS, POS, RPI, OUT_LOC, SEQ_LENS, PREFIX_LENS,
                          N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = tl.load(STAGED + offs * 4, mask=mask, other=0)
    seq = tl.load(STAGED + offs * 4 + 1, mask=mask, other=1)
    loc = tl.load(STAGED + offs * 4 + 2, mask=mask, other=0)
    entry = tl.load(STAGED + offs * 4 + 3, mask=mask, other=0)
    pos = seq - 1
    tl.store(IDS + offs, tl.load(TOKEN_BUF + row, mask=mask, other=0), mask=mask)
    tl.store(POS + offs, pos, mask=mask)
    tl.store(RPI + offs, row, mask=mask)
    tl.store(OUT_LOC + offs, loc, mask=mask)
    tl.store(SEQ_LENS + offs, seq.to(tl.int32), mask=mask)
    tl.store(PREFIX_LENS + offs, pos.to(tl.int32), mask=mask)
    tl.store(REQ_TO_TOKEN + row * stride_rt + pos, entry.to(tl.int32), mask=mask)


def unpack_decode_inputs(staged: torch.Tensor, token_buf: torch.Tensor, req_to_token: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor, req_pool_indices: torch.Tensor,
                         out_cache_loc: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor) -> None:
    """staged: contiguous int64 [B, 4] (columns ROWS, SEQ, LOC, TABLE; every context length >= 1);
    token_buf int64 [rows]; req_to_token int32 [rows, max_len]; outputs contiguous [B]. Writes
    input_ids = token_buf[rows], positions = seq - 1, req_pool_indices = rows, out_cache_loc = loc (int64),
    seq_lens = seq and prefix_lens = seq - 1 (int32), and req_to_token[rows, seq - 1] = table."""
    B = staged.shape[0]
    assert staged.dtype == torch.int64 and staged.shape[1] == 4 and staged.is_contiguous()
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    if B:
        BLOCK = 128
        _decode_inputs_kernel[(triton.cdiv(B, BLOCK),)](
            staged, token_buf, req_to_token, req_to_token.stride(0), input_ids, positions, req_pool_indices,
            out_cache_loc, seq_lens, prefix_lens, B, BLOCK=BLOCK, num_warps=4)
