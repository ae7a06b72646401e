"""Logit adjustments that depend on a request's own history: logit bias, repetition / frequency /
presence penalties, and the eos ban while min_new_tokens is not reached.

Built on the host once per step from plain lists, applied on the device with a handful of scatter /
elementwise ops and no host sync. A batch where no request uses any of them gets no `PenaltyState`
at all, so plain requests pay nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kernels.h2d import to_device

from shared.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def penalized(p: SamplingParams) -> bool:
    """Whether a request's sampling reads its own history (repetition, frequency, presence penalties)."""
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


@dataclass
class TokenIndex:
    """(row, token) pairs flattened over the batch: the sparse form of a per-request token list."""

    rows: torch.Tensor  # [N] int64
    cols: torch.Tensor  # [N] int64

    @classmethod
    def build(cls, rows: list[int], seqs: list[list[int]], vocab_size: int | None,
              device: torch.device) -> "TokenIndex | None":
        """Flatten `seqs[j]` (the tokens of request `rows[j]`). Ids outside [0, vocab_size) are
        dropped when `vocab_size` is given (user-supplied ids such as logit_bias keys)."""
        if vocab_size is not None:
            seqs = [[t for t in s if 0 <= t < vocab_size] for s in seqs]
        lens = [len(s) for s in seqs]
        if sum(lens) == 0:
            return None
        # repeat_interleave on host tensors: C speed, and no device sync for the output size.
        row_t = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64),
                                        torch.tensor(lens, dtype=torch.int64))
        # np.fromiter is ~10x faster than torch.tensor(list) for the long histories penalties see.
        col_t = torch.from_numpy(np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=sum(lens)))
        return cls(row_t.to(device, non_blocking=True), col_t.to(device, non_blocking=True))

    def dense_counts(self, batch_size: int, vocab_size: int) -> torch.Tensor:
        """[B, V] float32 occurrence counts."""
        counts = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=self.rows.device)
        ones = torch.ones(self.rows.shape[0], dtype=torch.float32, device=self.rows.device)
        return counts.index_put_((self.rows, self.cols), ones, accumulate=True)


@dataclass
class PenaltyState:
    batch_size: int
    vocab_size: int
    bias: TokenIndex | None = None
    bias_values: torch.Tensor | None = None  # [N] float32, aligned with `bias`
    seen: TokenIndex | None = None  # prompt + output tokens of rows with repetition_penalty != 1
    repetition: torch.Tensor | None = None  # [B] float32, 1.0 where unused
    output: TokenIndex | None = None  # output tokens of rows with frequency or presence penalty
    frequency: torch.Tensor | None = None  # [B, 1] float32
    presence: torch.Tensor | None = None  # [B, 1] float32
    banned: TokenIndex | None = None  # eos / stop ids of rows still under min_new_tokens

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]],
              prompt_ids: list[list[int]] | None, vocab_size: int, device: torch.device,
              eos_ids: list[list[int]] | None, min_new_active: list[bool]) -> "PenaltyState | None":
        b = len(params)
        st = cls(batch_size=b, vocab_size=vocab_size)

        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if bias_rows:
            items = [[(int(t), float(v)) for t, v in params[i].logit_bias.items() if 0 <= int(t) < vocab_size]
                     for i in bias_rows]
            st.bias = TokenIndex.build(bias_rows, [[t for t, _ in it] for it in items], None, device)
            if st.bias is not None:
                vals = [v for it in items for _, v in it]
                st.bias_values = to_device(vals, torch.float32, device)

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            seqs = [(prompt_ids[i] if prompt_ids is not None else []) + output_ids[i] for i in rep_rows]
            st.seen = TokenIndex.build(rep_rows, seqs, None, device)
            if st.seen is not None:
                st.repetition = torch.tensor([p.repetition_penalty for p in params],
                                             dtype=torch.float32).to(device, non_blocking=True)

        fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if fp_rows:
            st.output = TokenIndex.build(fp_rows, [output_ids[i] for i in fp_rows], None, device)
            if st.output is not None:
                fp = torch.tensor([[p.frequency_penalty for p in params], [p.presence_penalty for p in params]],
                                  dtype=torch.float32).to(device, non_blocking=True)
                st.frequency, st.presence = fp[0, :, None], fp[1, :, None]

        ban_rows = [i for i in range(b) if min_new_active[i]]
        if ban_rows:
            def stop_ids(i: int) -> list[int]:
                own = eos_ids[i] if eos_ids is not None else []
                return list(own) + list(params[i].stop_token_ids)
            st.banned = TokenIndex.build(ban_rows, [stop_ids(i) for i in ban_rows], vocab_size, device)

        if st.bias is None and st.seen is None and st.output is None and st.banned is None:
            return None
        return st

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjust float32 `logits` [B, V] in place, in the order users expect: bias, repetition,
        frequency/presence, then the eos ban (last, so no bias can lift a banned token)."""
        if self.bias is not None:
            logits.index_put_((self.bias.rows, self.bias.cols), self.bias_values, accumulate=True)
        if self.seen is not None:
            # Gather-modify-scatter over the seen tokens only; duplicate (row, token) pairs all
            # compute the same value from the same original logit, so the write is idempotent.
            idx = (self.seen.rows, self.seen.cols)
            old = logits[idx]
            pen = self.repetition[self.seen.rows]
            logits.index_put_(idx, torch.where(old > 0, old / pen, old * pen))
        if self.output is not None:
            counts = self.output.dense_counts(self.batch_size, self.vocab_size)
            logits -= counts * self.frequency + (counts > 0).to(torch.float32) * self.presence
        if self.banned is not None:
            ninf = torch.full(self.banned.rows.shape, _NEG_INF, dtype=logits.dtype, device=logits.device)
            logits.index_put_((self.banned.rows, self.banned.cols), ninf)
        return logits
