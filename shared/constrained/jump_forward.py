"""Jump-forward decoding over a compressed FSM (SGLang paper, section 4).

When the grammar admits exactly one continuation for a while (`{"name": "` after `{`), those
characters need no sampling: we append them in one extend step instead of one decode step each.

Appending the forced text as its own tokens would show the model a tokenization it never saw in
training (`"` + `name` where BPE writes `"name`), so the boundary is re-tokenized: the last few
generated tokens' text plus the forced text is encoded again, and the caller replaces those
tokens with the result. Only the part that changed is returned (`rollback` tokens out, `new_ids`
in), so in the common case nothing is rolled back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shared.constrained.matcher import GrammarState
from shared.constrained.vocab import VocabIndex
from shared.tokenizer import Tokenizer

# How many trailing output tokens may be re-tokenized. Each one beyond the last sampled token
# already has KV in the cache, which the engine must drop; 2 covers a split UTF-8 character and
# the usual BPE merge across the boundary.
DEFAULT_MAX_RETOKENIZE = 2


class RetokenizeMemo:
    """Boundary encodings already computed, by (tail tokens, forced text): one per tokenizer (and its
    grammars' vocabulary). The encoding is a function of that text alone, and the same boundaries
    come up again and again: every request of a schema passes the same keys, enum tails and
    punctuation, mostly after the same sampled token (bench/structured.py, 64 requests of a random-weight
    model: 600 boundaries, 28 distinct), so most jumps skip the tokenizer. Bounded in entries, and long forced
    runs (rare, and their encoding is cheap per token) are not kept."""

    def __init__(self, max_entries: int = 4096, max_forced_chars: int = 512):
        self.max_entries = max_entries
        self.max_forced_chars = max_forced_chars
        self._ids: dict[tuple[tuple[int, ...], str], list[int] | None] = {}
        self.hits = 0
        self.misses = 0

    def ids(self, tail: list[int], forced: str, encode: Callable[[], list[int] | None]) -> list[int] | None:
        """The boundary's ids (None: its encoding does not round-trip), from `encode()` if not known."""
        key = (tuple(tail), forced)
        if key in self._ids:
            self.hits += 1
            return self._ids[key]
        self.misses += 1
        ids = encode()
        if len(forced) <= self.max_forced_chars:
            if len(self._ids) >= self.max_entries:
                del self._ids[next(iter(self._ids))]  # the oldest entry
            self._ids[key] = ids
        return ids

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class JumpForward:
    forced_text: str  # what the grammar forced (informational; the ids are authoritative)
    rollback: int  # drop this many trailing output tokens ...
    new_ids: list[int]  # ... then append these (the matcher has already accepted them)


def jump_forward(state: GrammarState, output_ids: list[int], tokenizer: Tokenizer, *,
                 max_retokenize: int = DEFAULT_MAX_RETOKENIZE, budget: int | None = None,
                 memo: RetokenizeMemo | None = None) -> JumpForward | None:
    """Advance `state` over the forced text; None when nothing is forced (or jump-forward is off).

    `output_ids` are the request's generated tokens so far, all accepted by `state`. `budget`
    caps the net growth of the output (tokens left before max_new_tokens). On success the matcher
    stands after `output_ids[:len - rollback] + new_ids`; on None it is unchanged.
    """
    jf = plan_jump(state, output_ids, tokenizer, max_retokenize=max_retokenize, budget=budget, memo=memo)
    return jf if jf is not None and apply_jump(state, jf, output_ids) else None


def forced_text(state: GrammarState) -> str:
    """The text the grammar forces next ("" when jump-forward is off or nothing is forced)."""
    return state.find_jump_forward_string() if state.jump_forward else ""


def plan_jump(state: GrammarState, output_ids: list[int], tokenizer: Tokenizer, *,
              max_retokenize: int = DEFAULT_MAX_RETOKENIZE, budget: int | None = None,
              forced: str | None = None, memo: RetokenizeMemo | None = None) -> JumpForward | None:
    """The jump `jump_forward` would make, without touching the matcher (so a caller can weigh several
    before taking any: `apply_jump`). `forced`: the forced text when the caller already has it; `memo`:
    boundary encodings of earlier jumps with this tokenizer (the caller's, kept across calls)."""
    if not state.jump_forward or (budget is not None and budget <= 0):
        return None
    forced = state.find_jump_forward_string() if forced is None else forced
    if not forced:
        return None
    if budget is not None:
        # No token stands for more than max_token_bytes characters, so this many characters give at
        # least budget + 1 tokens: never tokenize (or hold) a forced run longer than the output may grow.
        forced = forced[:(budget + max_retokenize + 1) * state.vocab.max_token_bytes]
    tb = state.vocab.token_bytes
    tail, ids = _retokenize(state, output_ids, tokenizer, forced, max_retokenize, memo)
    if ids is None:
        # The tokenizer does not round-trip this text on its own (a SentencePiece prefix space,
        # a normalizer, a special token): append xgrammar's own greedy tokens for the forced
        # text, which already leave out an extendable last token.
        tail, ids = [], state.matcher.find_jump_forward_tokens()
    k = len(tail)
    common = _common_prefix(ids, tail)
    rollback, new_ids = k - common, ids[common:]
    if budget is not None:
        new_ids = new_ids[:budget + rollback]
    removed_bytes = b"".join([tb[t] for t in tail[common:]])
    added_bytes = b"".join([tb[t] for t in new_ids])
    # Never lose generated text, and make progress.
    if len(added_bytes) <= len(removed_bytes) or not added_bytes.startswith(removed_bytes):
        return None
    return JumpForward(forced_text=forced, rollback=rollback, new_ids=new_ids)


def apply_jump(state: GrammarState, jf: JumpForward, output_ids: list[int], *, final: bool = False) -> bool:
    """Advance the matcher over a planned jump (`output_ids` as when it was planned); False, with the
    matcher unchanged, when the grammar refuses the new tokens. `final`: the jump's tokens will never
    be rolled back (they are not proposals), so the matcher takes them as one step, far cheaper
    (GrammarState.accept_forced_run)."""
    state.rollback(jf.rollback)
    accept = state.accept_forced_run if final else state.accept_tokens
    if not accept(jf.new_ids):
        restored = state.accept_tokens(output_ids[len(output_ids) - jf.rollback:] if jf.rollback else [])
        assert restored, "re-accepting previously accepted tokens cannot fail"
        return False
    return True


def _retokenize(state: GrammarState, output_ids: list[int], tokenizer: Tokenizer, forced: str,
                max_retokenize: int, memo: RetokenizeMemo | None = None) -> tuple[list[int], list[int] | None]:
    """(tail, ids): the trailing output tokens to replace and the tokenizer's own encoding of
    their text + the forced text; ids is None when that encoding does not reproduce the bytes."""
    k = _tail_length(state, output_ids, max_retokenize)
    tail = list(output_ids[len(output_ids) - k:])
    if memo is None:
        return tail, _encode_boundary(state.vocab, tokenizer, tail, forced)
    return tail, memo.ids(tail, forced, lambda: _encode_boundary(state.vocab, tokenizer, tail, forced))


def _encode_boundary(vocab: VocabIndex, tokenizer: Tokenizer, tail: list[int], forced: str) -> list[int] | None:
    """The tokenizer's encoding of the tail tokens' text + the forced text, less a final token a longer
    one extends (see below); None when it does not reproduce their bytes. Callers must not mutate it
    (RetokenizeMemo hands the same list out again)."""
    tb = vocab.token_bytes
    tail_bytes = b"".join([tb[t] for t in tail])
    forced_bytes = forced.encode()
    ids = tokenizer.raw.encode(tail_bytes.decode("utf-8") + forced, add_special_tokens=False).ids
    if max(ids, default=-1) >= len(tb) or b"".join([tb[t] for t in ids]) != tail_bytes + forced_bytes:
        return None
    # A final token that a longer token extends would likely have merged with what the model
    # writes next; leave those characters to the model (the mask still forces them) unless the
    # token reaches back into text that was already generated (the ids spell tail + forced, so the
    # ones before it reach past the tail exactly when the forced text is at least that token).
    if ids and vocab.is_extendable(ids[-1]) and len(forced_bytes) >= len(tb[ids[-1]]):
        ids = ids[:-1]
    return ids


def _tail_length(state: GrammarState, output_ids: list[int], max_retokenize: int) -> int:
    """Largest k <= max_retokenize whose last-k tokens are ordinary, accepted by this matcher,
    and start on a UTF-8 character boundary (so their text can be re-encoded exactly)."""
    tb, special = state.vocab.token_bytes, state.vocab.special_ids
    k = min(max_retokenize, state.num_accepted, len(output_ids))
    while k > 0:
        tail = output_ids[len(output_ids) - k:]
        if not any(t in special or t >= len(tb) for t in tail):
            try:
                b"".join(tb[t] for t in tail).decode("utf-8")
                return k
            except UnicodeDecodeError:
                pass
        k -= 1
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
