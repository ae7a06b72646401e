"""The tokenizer as xgrammar sees it, built once per worker from our own `Tokenizer`.

xgrammar's `TokenizerInfo.from_huggingface` wants a `transformers` tokenizer; we hold a bare
`tokenizers.Tokenizer`, so we build the info from its vocabulary and serialized JSON ourselves.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import xgrammar as xgr

from shared.tokenizer import Tokenizer


def build_tokenizer_info(tokenizer: Tokenizer, model_vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """TokenizerInfo over the tokenizer's own ids, capped at the model's vocab (lm_head rows).

    lm_head padding (model ids the tokenizer does not define) is left out of xgrammar's vocabulary:
    xgrammar lists every id without text as a special token and scans that list on every
    accept_token, which with 128k padding ids (an 8B lm_head over a small tokenizer) cost ~24 us a
    token against ~1 us. So the grammar's masks are narrower than the logits when the model pads;
    `GrammarState.fill_bitmask` and `MaskBuilder` widen them, padding disallowed (the engine also
    never samples padding). Special added tokens other than eos are blanked: their text is dropped on
    detokenization, so letting a grammar spell "<|endoftext|>" with one of them would produce output
    that no longer matches the grammar; xgrammar treats a blank id as special and never allows it.
    """
    vocab = tokenizer.raw.get_vocab(with_added_tokens=True)
    size = max(max(vocab.values()) + 1, len(vocab))
    if model_vocab_size:
        size = min(size, model_vocab_size)
    hidden = {i for i, t in tokenizer.raw.get_added_tokens_decoder().items()
              if t.special and i not in tokenizer.eos_token_ids}
    encoded = [""] * size
    for token, idx in vocab.items():
        if idx < size and idx not in hidden:
            encoded[idx] = token
    vocab_type, add_prefix_space = _detect_encoding(tokenizer, vocab)
    stop_ids = [i for i in tokenizer.eos_token_ids if i < size]
    if not stop_ids:
        raise ValueError("constrained decoding needs at least one eos token id inside the model vocab")
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=size, stop_token_ids=stop_ids,
                             add_prefix_space=add_prefix_space)


def _detect_encoding(tokenizer: Tokenizer, vocab: dict[str, int]) -> tuple[xgr.VocabType, bool]:
    # The serialized pipeline (decoder, pre-tokenizer) says how tokens spell bytes; the vocabulary
    # itself is the tie-breaker when the two disagree, as xgrammar's own HF path does.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.raw.to_str())
    vocab_type, add_prefix_space = meta["vocab_type"], bool(meta["add_prefix_space"])
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type = from_vocab
        first = tokenizer.raw.encode("a", add_special_tokens=False).tokens
        marker = "\u2581" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "\u0120"
        add_prefix_space = bool(first) and first[0].startswith(marker)
    return vocab_type, add_prefix_space


@dataclass
class VocabIndex:
    """Byte strings of every token plus which tokens a longer token extends.

    Jump-forward needs both: exact bytes to rebuild text at a token boundary without lossy
    decoding, and the extendable set to avoid ending a forced run on a token the model would
    normally have merged with what follows.
    """
    token_bytes: list[bytes]
    special_ids: frozenset[int]
    extendable_ids: frozenset[int] = field(repr=False)
    max_token_bytes: int = 1  # the longest token's byte length (bounds the text a token stands for)
    # Ordinary tokens by their bytes (several ids may spell the same bytes), and those bytes sorted:
    # `prefix_tokens` reads both.
    ids_by_bytes: dict[bytes, tuple[int, ...]] = field(default_factory=dict, repr=False)
    sorted_bytes: list[bytes] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, info: xgr.TokenizerInfo) -> "VocabIndex":
        token_bytes = list(info.decoded_vocab)
        special = frozenset(info.special_token_ids) | frozenset(info.stop_token_ids)
        ordinary = sorted((b, i) for i, b in enumerate(token_bytes) if i not in special and b)
        # In sorted order every string that starts with t sits right after t (past exact
        # duplicates), so one look at the next distinct token decides; O(V log V), no prefix set.
        extendable: set[int] = set()
        j = 0
        for k, (b, i) in enumerate(ordinary):
            j = max(j, k + 1)
            while j < len(ordinary) and ordinary[j][0] == b:
                j += 1
            if j < len(ordinary) and ordinary[j][0].startswith(b):
                extendable.add(i)
        longest = max((len(b) for i, b in enumerate(token_bytes) if i not in special), default=1)
        by_bytes: dict[bytes, list[int]] = {}
        for b, i in ordinary:
            by_bytes.setdefault(b, []).append(i)
        return cls(token_bytes=token_bytes, special_ids=special, extendable_ids=frozenset(extendable),
                   max_token_bytes=max(1, longest), ids_by_bytes={b: tuple(v) for b, v in by_bytes.items()},
                   sorted_bytes=list(by_bytes))

    @property
    def size(self) -> int:
        """Ids the grammar knows (xgrammar's vocab_size): its masks cover these."""
        return len(self.token_bytes)

    def is_extendable(self, token_id: int) -> bool:
        return token_id in self.extendable_ids

    def prefix_tokens(self, text: bytes) -> list[int] | None:
        """The ordinary tokens that spell a non-empty prefix of `text`: when the grammar forces `text`
        next, exactly the tokens it allows, unless some token spells `text` and then more (whether
        that one is allowed depends on what the grammar takes after `text`): then None."""
        if not text:
            return None
        i = bisect.bisect_right(self.sorted_bytes, text)
        if i < len(self.sorted_bytes) and self.sorted_bytes[i].startswith(text):
            return None
        ids: list[int] = []
        for n in range(1, min(len(text), self.max_token_bytes) + 1):
            ids.extend(self.ids_by_bytes.get(text[:n], ()))
        return ids
