"""Batch token masks: one packed int32 bitmask per step, filled on the host, applied on the device.

Rows of unconstrained requests stay all-ones and are skipped when applying; a batch without any
grammar builds nothing at all (`MaskBuilder.build` returns None).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import xgrammar as xgr

from shared.constrained.matcher import GrammarState


@dataclass
class GrammarMask:
    bitmask: torch.Tensor  # int32 [B, W], bit j of row i set = token j allowed
    rows: list[int]  # rows that carry a grammar; the others are all-ones
    vocab_size: int  # model vocab V (logits width)
    # The grammars' vocab when narrower than V (lm_head padding left out of xgrammar's vocab, see
    # vocab.build_tokenizer_info): the bitmask then covers only it, and the columns past it are
    # disallowed in constrained rows, untouched in the others (`free`: bool [B], True for those).
    grammar_vocab_size: int | None = None
    free: torch.Tensor | None = None
    # The host bitmask a device copy was made from: its filled rows stay readable without a copy back (the
    # draft model's masks, handed to the engine's verification).
    host: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "GrammarMask":
        free = self.free.to(device, non_blocking=True) if self.free is not None else None
        return GrammarMask(self.bitmask.to(device, non_blocking=True), self.rows, self.vocab_size,
                           self.grammar_vocab_size, free, self.host_bitmask)

    @property
    def host_bitmask(self) -> torch.Tensor:
        return self.host if self.host is not None else self.bitmask

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed logits to -inf in place (rows without a grammar are untouched)."""
        if self.grammar_vocab_size is not None:
            logits.masked_fill_(~self.to_bool().to(logits.device)[:, :logits.shape[-1]], float("-inf"))
            return
        apply_bitmask(logits, self.bitmask, rows=self.rows, vocab_size=self.vocab_size)

    def to_bool(self) -> torch.Tensor:
        """bool [B, V] of allowed tokens, on the bitmask's device (the sampler's `vocab_mask`)."""
        if self.grammar_vocab_size is None:
            return bitmask_to_bool(self.bitmask, self.vocab_size)
        g = self.grammar_vocab_size
        allowed = bitmask_to_bool(self.bitmask, g)
        return torch.cat([allowed, self.free[:, None].expand(allowed.shape[0], self.vocab_size - g)], dim=1)


class MaskBuilder:
    """Fills the rows of constrained requests: one after another on this thread, or spread over
    xgrammar's threads when the rows' own fill work is large enough to pay for the hand-off.

    xgrammar's threaded batch fill costs about 2 ms a call however little there is to fill (on the
    2-core CI machine: 64 µs per row at 32 rows with 2 threads, against 1.4 µs per row filled serially;
    on the H200's host, 8 threads, 88 µs per row), which at batch 32 is a decode step's worth of host
    time. So the serial cost per row is measured as it goes, and threads take over only for a batch
    whose serial fill would exceed THREADED_FILL_S; a serial fill every RESAMPLE_STEPS threaded ones
    keeps the estimate current.
    """

    THREADED_FILL_S = 0.002
    RESAMPLE_STEPS = 64

    def __init__(self, vocab_size: int, max_threads: int = 2):
        self.vocab_size = vocab_size
        self._batch = xgr.BatchGrammarMatcher(max_threads) if max_threads > 1 else None
        self.row_fill_s = 0.0  # serial fill seconds per row (moving average); 0 until measured
        self._threaded_in_a_row = 0

    def _fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        if (self._batch is not None and len(rows) * self.row_fill_s > self.THREADED_FILL_S
                and self._threaded_in_a_row < self.RESAMPLE_STEPS):
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            self._threaded_in_a_row += 1
            return
        t0 = time.perf_counter()
        for m, row in zip(matchers, rows):
            m.fill_next_token_bitmask(bitmask, row)
        per_row = (time.perf_counter() - t0) / len(rows)
        self.row_fill_s = per_row if self.row_fill_s == 0 else 0.8 * self.row_fill_s + 0.2 * per_row
        self._threaded_in_a_row = 0

    def build(self, states: Sequence[GrammarState | None], device: torch.device | str | None = None
              ) -> GrammarMask | None:
        rows = [i for i, s in enumerate(states) if s is not None and not s.failed and not s.is_terminated()]
        if not rows:
            return None
        device = torch.device(device) if device is not None else torch.device("cpu")
        # Pinned host memory lets the copy overlap; torch's caching host allocator makes a fresh
        # buffer per step cheap and keeps it alive until the async copy has finished.
        pin = device.type == "cuda"
        # The grammars' own width, narrower than the logits when the model pads its vocab: xgrammar
        # fills rows of exactly that width. States of several widths (not from one GrammarCache) take
        # the model's, each row widened by its state.
        widths = {states[i].vocab.size for i in rows}
        g = widths.pop() if len(widths) == 1 else None
        direct = g is not None and g <= self.vocab_size
        if not direct:
            g = self.vocab_size
        bitmask = torch.full(xgr.get_bitmask_shape(len(states), g), -1, dtype=xgr.bitmask_dtype, pin_memory=pin)
        if direct:
            self._fill([states[i].matcher for i in rows], bitmask, rows)
        else:
            for i in rows:
                states[i].fill_bitmask(bitmask, i)
        free = None
        if g < self.vocab_size:
            free = torch.ones(len(states), dtype=torch.bool, pin_memory=pin)
            free[rows] = False
        mask = GrammarMask(bitmask, rows, self.vocab_size, g if free is not None else None, free)
        return mask.to(device) if device.type != "cpu" else mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *, rows: list[int] | None = None,
                  vocab_size: int | None = None) -> None:
    """logits[B, V] = -inf where the bit is 0, with xgrammar's kernel for the logits' device (CPU,
    CUDA/Triton). `rows` limits the work to constrained requests."""
    if logits.shape[-1] > bitmask.shape[-1] * 32:
        raise ValueError(f"logits have {logits.shape[-1]} columns but the bitmask covers "
                         f"{bitmask.shape[-1] * 32}; build it with the model's vocab size")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is not None and len(rows) == logits.shape[0]:
        rows = None  # every row constrained: the kernel's dense path
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size or logits.shape[-1], indices=rows)


def set_allowed(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """bitmask[row] (a host int32 bitmask) allows exactly `token_ids`: the row for a position whose
    allowed tokens are known without asking the matcher (inside a forced run)."""
    words = bitmask[row].numpy().view(np.uint32)
    words[:] = 0
    ids = np.asarray(token_ids, dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack int32 [B, W] bits into bool [B, vocab_size] on the bitmask's device (one fused pass)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
