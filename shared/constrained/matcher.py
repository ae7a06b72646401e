"""Per-request grammar state: which tokens may come next, and when the output is complete."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from shared.constrained.vocab import VocabIndex


@dataclass
class GrammarState:
    """Wraps one xgrammar GrammarMatcher and counts the tokens it can roll back one by one.

    The count bounds rollback: jump-forward may only re-tokenize output that this matcher
    accepted (not, say, a first token the grammar never saw), and never into a forced run taken
    as one step (`accept_forced_run`).
    """
    matcher: xgr.GrammarMatcher
    compiled: xgr.CompiledGrammar
    vocab: VocabIndex
    jump_forward: bool = True
    num_accepted: int = 0
    # Set when a token outside the grammar arrived (a sampler that ignored the mask):
    # the request cannot be continued validly and must be aborted.
    failed: bool = False
    _row: torch.Tensor | None = field(default=None, repr=False, compare=False)  # fill_bitmask's scratch

    @property
    def mask_words(self) -> int:
        """int32 words of this grammar's own mask row (its vocab: the tokenizer's ids, no lm_head padding)."""
        return (self.vocab.size + 31) // 32

    @classmethod
    def create(cls, compiled: xgr.CompiledGrammar, vocab: VocabIndex, *, jump_forward: bool = True
               ) -> "GrammarState":
        return cls(matcher=xgr.GrammarMatcher(compiled), compiled=compiled, vocab=vocab, jump_forward=jump_forward)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (and `failed`) if the grammar forbids it."""
        if self.failed:
            return False
        if not 0 <= token_id < self.vocab.size or not self.matcher.accept_token(int(token_id)):
            self.failed = True
            return False
        self.num_accepted += 1
        return True

    def try_accept(self, token_id: int) -> bool:
        """accept_token for a guess (a speculative draft): a refused token leaves the matcher as it was and
        usable, not failed."""
        if self.failed or not 0 <= token_id < self.vocab.size or not self.matcher.accept_token(int(token_id)):
            return False
        self.num_accepted += 1
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """All or nothing: on a rejection the matcher is left as it was."""
        taken = 0
        n = self.vocab.size
        for t in token_ids:
            if not 0 <= t < n or not self.matcher.accept_token(int(t)):
                if taken:
                    self.matcher.rollback(taken)
                return False
            taken += 1
        self.num_accepted += taken
        return True

    def accept_forced_run(self, token_ids: list[int]) -> bool:
        """accept_tokens for a run of tokens that will never be rolled back (jump-forward's forced
        text): the matcher takes their bytes as one step, in one call instead of one per token, and
        stands where accept_tokens would leave it (xgrammar matches ordinary tokens by their bytes). Neither the run nor anything before it can be rolled
        back afterwards: the count restarts at 0. A run holding a special or stop token, which
        accept_token treats apart from its text, or one the string match refuses, goes token by token."""
        n, special = self.vocab.size, self.vocab.special_ids
        if any(t in special or not 0 <= t < n for t in token_ids):
            return self.accept_tokens(token_ids)
        tb = self.vocab.token_bytes
        if not self.matcher.accept_string(b"".join([tb[t] for t in token_ids])):
            return self.accept_tokens(token_ids)  # the refused string left the matcher as it was
        self.num_accepted = 0
        return True

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens; {self.num_accepted} accepted")
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed-next-token bits into bitmask[row] (a host int32 bitmask of this grammar's
        width, or wider: the model's, whose columns past the grammar's vocab are lm_head padding and
        come out disallowed). True if anything is masked."""
        words = self.mask_words
        if bitmask.shape[-1] == words:
            return self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._row is None:
            self._row = torch.empty((1, words), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(self._row, 0)
        self._widen(bitmask, row, self._row[0])
        return True

    def put_bitmask(self, bitmask: torch.Tensor, row: int, filled: torch.Tensor) -> bool:
        """Write into bitmask[row] exactly what fill_bitmask would, from a row this matcher filled at its
        current position before (the draft model's masks: filled while drafting, not filled twice). `filled`
        is of bitmask's width or of this grammar's own; False (nothing written) for any other."""
        if filled.shape[-1] == bitmask.shape[-1]:
            bitmask[row] = filled
        elif filled.shape[-1] == self.mask_words:
            self._widen(bitmask, row, filled)
        else:
            return False
        return True

    def _widen(self, bitmask: torch.Tensor, row: int, own: torch.Tensor) -> None:
        """bitmask[row] (wider than this grammar's mask) from a row of its own width: the columns past its
        vocab (lm_head padding) disallowed."""
        words = self.mask_words
        bitmask[row, :words] = own
        bitmask[row, words:] = 0
        tail = self.vocab.size % 32
        if tail:
            bitmask[row, words - 1] &= (1 << tail) - 1

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request is done (finish reason: stop)."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a full match (eos would be accepted now)."""
        return self.matcher.is_completed()

    def find_jump_forward_string(self) -> str:
        if self.failed or self.matcher.is_terminated():
            return ""
        return self.matcher.find_jump_forward_string()

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (for n > 1 sharing a prompt)."""
        return GrammarState(matcher=self.matcher.fork(), compiled=self.compiled, vocab=self.vocab,
                            jump_forward=self.jump_forward, num_accepted=self.num_accepted, failed=self.failed)
