"""NGRAM speculation (prompt lookup): drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens in the request's own prompt and output, n from the longest window down.

Each request keeps an index of its n-grams (every window size) to where each last ended, grown by the
tokens confirmed since the previous lookup, so a lookup costs a few dict probes whatever the length."""
from __future__ import annotations


class NgramIndex:
    """One request's n-grams of sizes lo..hi over its confirmed tokens, each mapped to the position just
    after its latest occurrence that is not the sequence's own suffix."""

    __slots__ = ("lo", "hi", "tokens", "_ends", "_indexed")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions up to this are in _ends

    def sync(self, prompt: list[int], output: list[int], num_confirmed: int) -> None:
        """Take the request's confirmed tokens, prompt + output[:num_confirmed] (only the unseen tail is read)."""
        toks = self.tokens
        if len(toks) < len(prompt):
            toks.extend(prompt[len(toks):])
        done = len(toks) - len(prompt)
        if num_confirmed > done:
            toks.extend(output[done:num_confirmed])

    def _index_until(self, end: int) -> None:
        """Index the n-grams ending at positions (_indexed, end]."""
        toks, ends = self.tokens, self._ends
        for e in range(self._indexed + 1, end + 1):
            for n in range(self.lo, min(self.hi, e) + 1):
                ends[tuple(toks[e - n:e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to k drafts: what followed the longest suffix seen before (nothing when none was)."""
        toks = self.tokens
        L = len(toks)
        # Everything but the suffixes ending at L itself is indexed: a match is an earlier occurrence.
        self._index_until(L - 1)
        ends = self._ends
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            e = ends.get(tuple(toks[L - n:L]))
            if e is not None:
                return toks[e:min(e + k, L)]
        return []
