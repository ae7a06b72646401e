"""Worker logprob entries ([logprob, token_id], tops as lists of those) in each API's shape."""
from __future__ import annotations

from typing import Sequence

from shared.tokenizer import Tokenizer


def align_to_positions(entries: Sequence, n_positions: int) -> list:
    """Entries cover the last len(entries) positions; earlier ones (and a missing first one) get None."""
    entries = list(entries)[-n_positions:] if n_positions else []
    return [None] * (n_positions - len(entries)) + entries


# ---------------------------------------------------------------- SGLang native
def native_entries(entries: Sequence, tok: Tokenizer, with_text: bool) -> list:
    return [_native(e, tok, with_text) for e in entries]


def native_tops(positions: Sequence, tok: Tokenizer, with_text: bool) -> list:
    return [None if pos is None else [_native(e, tok, with_text) for e in pos] for pos in positions]


def _native(entry, tok: Tokenizer, with_text: bool) -> list:
    logprob, token_id = entry[0], int(entry[1])
    return [logprob, token_id, tok.token_text(token_id) if with_text else None]


# ---------------------------------------------------------------- OpenAI completions (legacy shape)
def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence, tops: Sequence, tok: Tokenizer,
                        offset: int) -> dict:
    """`offset`: character position of the first token in the choice's text (text_offset)."""
    tokens = [tok.token_text(t) for t in token_ids]
    logprobs = align_to_positions(logprobs, len(token_ids))
    tops = align_to_positions(tops, len(token_ids))
    text_offset = []
    for t in tokens:
        text_offset.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[0] for e in logprobs],
        "top_logprobs": [None if pos is None else {tok.token_text(int(tid)): lp for lp, tid in pos}
                         for pos in tops],
        "text_offset": text_offset,
    }


def merge_completion_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


# ---------------------------------------------------------------- OpenAI chat
def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence, tops: Sequence, tok: Tokenizer) -> dict:
    logprobs = align_to_positions(logprobs, len(token_ids))
    tops = align_to_positions(tops, len(token_ids))
    content = []
    for tid, entry, pos in zip(token_ids, logprobs, tops):
        item = _chat_token(tok.token_text(tid), None if entry is None else entry[0])
        item["top_logprobs"] = [_chat_token(tok.token_text(int(t)), lp) for lp, t in (pos or [])]
        content.append(item)
    return {"content": content}


def _chat_token(text: str, logprob: float | None) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
