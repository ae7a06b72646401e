"""A residual RMSNorm split across the two GEMVs around it, for one row (decode at batch 1), or two on the GEMV's
one-row kernel (each row its own partial sums).

Unfused, a decoder layer's `h = W_o o; r = r + h; x = rmsnorm(r) * gamma; y = W_qkv x` is three kernels, and
the norm in the middle is a short launch whose only job is one reduction. Split, it costs no kernel:

- the producer GEMV (o_proj, down_proj) adds its output into the residual rows it owns, writes
  g = gamma * r for those rows and adds their sum of squares into one of NORM_SLOTS fp64 partials;
- the consumer GEMV (qkv_proj, gate_up_proj) reads g as its input and scales its outputs by
  rsqrt(mean(r^2) + eps), linear in the input, from the partials' sum.

Rounding follows the unfused layer where it can: h is rounded to the activation dtype before the add and
the sum is rounded before it is squared; the consumer rounds g (not r / rms(r)) and applies the scale in
fp32 before its one output rounding. Partials are spread over NORM_SLOTS addresses so that thousands of
programs do not queue on one atomic; fp64 keeps their sum exact to far below the fp32 scale's precision
whatever the order the atomics land in.
"""
from __future__ import annotations

import dataclasses

import torch

NORM_SLOTS = 16


@dataclasses.dataclass(frozen=True)
class ResidualNorm:
    """One site: `residual` [1, H] (updated in place by the producer), `weight` the norm's gamma [H],
    `sumsq` fp64 [NORM_SLOTS] partials, zero before the producer runs, `eps` the norm's epsilon. Two rows: residual
    [2, H] and sumsq [2, NORM_SLOTS], a row's partials after the other's."""
    residual: torch.Tensor
    weight: torch.Tensor
    sumsq: torch.Tensor
    eps: float

    def __post_init__(self):
        assert self.residual.dim() == 2 and self.rows in (1, 2) and self.residual.is_contiguous()
        assert self.weight.shape == (self.residual.shape[1],)
        assert self.sumsq.shape == ((NORM_SLOTS,) if self.rows == 1 else (self.rows, NORM_SLOTS))
        assert self.sumsq.dtype == torch.float64 and self.sumsq.is_contiguous()

    @property
    def rows(self) -> int:
        return self.residual.shape[0]

    @property
    def size(self) -> int:
        return self.residual.shape[1]
