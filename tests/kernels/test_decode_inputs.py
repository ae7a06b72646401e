"""The decode step's inputs unpacked on the device (kernels/decode_inputs.py)."""
from __future__ import annotations

import torch

from tests.kernels._runner import kernel_tests


def check_decode_inputs(device, dtype):
    """One staged block unpacked as the reference does: input tokens gathered from the request rows,
    positions, rows, slots and lengths, the slot-table entry written (padding rows: row 0, length 1,
    slot 0)."""
    from kernels.decode_inputs import unpack_decode_inputs
    from kernels.reference import decode_inputs_ref
    g = torch.Generator().manual_seed(3)
    for B, pad in [(1, 0), (5, 3), (130, 6)]:
        rows = torch.randperm(200, generator=g)[:B] + 1
        seq = torch.randint(1, 40, (B,), generator=g)
        loc = torch.randint(1, 10_000, (B,), generator=g)
        zeros = torch.zeros(pad, dtype=torch.int64)
        staged = torch.stack([torch.cat([rows, zeros]), torch.cat([seq, zeros + 1]), torch.cat([loc, zeros]),
                              torch.cat([loc + 7, zeros])], dim=1).contiguous().to(device)
        token_buf = torch.randint(0, 32_000, (201,), generator=g).to(device)
        table = torch.randint(0, 10_000, (201, 48), generator=g, dtype=torch.int32).to(device)
        table[0] = 0
        n = B + pad
        outs = [torch.full((n,), -1, dtype=dt, device=device) for dt in (torch.int64,) * 4 + (torch.int32,) * 2]
        want = decode_inputs_ref(staged, token_buf, table)
        unpack_decode_inputs(staged, token_buf, table, *outs)
        for got, ref in zip(outs + [table], want):
            assert got.dtype == ref.dtype and torch.equal(got, ref), f"decode inputs differ (B={B}, pad={pad})"


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
