"""L2 prefetches of weights issued beside the decode chain, not in it.

At batch 1, rope and decode attention sit between the qkv and o_proj GEMVs and leave the memory system nearly
idle (microseconds a layer); o_proj's weight (32 MiB in bf16 on an 8B Llama) fits a Hopper GPU's 50 MiB L2. The prefetch kernel runs on a side stream forked from the model's stream after qkv_proj, so it
overlaps rope and attention instead of adding a kernel boundary to the chain, and it starts only once qkv_proj
has finished streaming (no competition for bandwidth). join() brings the side stream back before the pass ends,
as CUDA graph capture requires of every fork.
"""
from __future__ import annotations

import torch

from kernels import ops


class WeightPrefetcher:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pending = False

    def prefetch(self, t: torch.Tensor) -> None:
        """Ask for t to be brought into L2 once the work queued so far on the current stream is done."""
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            ops.l2_prefetch(t, pdl=False)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False
